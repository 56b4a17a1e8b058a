"""The synthesizer: a Ray Serve deployment that receives branch KV and answers from it."""

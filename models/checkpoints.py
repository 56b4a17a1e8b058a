"""Random-weight checkpoints built from a config and saved to disk.

Nothing can be downloaded from a model hub here, so tests, the demo and the
benchmark build a model of the right family and shape with random weights, save it
with `save_pretrained`, and load it back through the same path-based loader a real
checkpoint uses.
"""

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=8192),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, vocab_size=16384, max_position_embeddings=8192),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
}

_CORPUS = [
    "The workers explore the problem in parallel and the synthesizer combines their answers.",
    "Each branch writes a partial result; the final answer adds the partial results together.",
    "User: What is the capital of France? Assistant: The capital of France is Paris.",
    "Question one asks for a sum, question two asks for a product, and both must be answered.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * = ( ) , . ; : ! ?",
]


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer: any text encodes, nothing is downloaded."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_config(family: str = "llama", shape: str = "tiny", **overrides):
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {sorted(FAMILIES)}")
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {sorted(SHAPES)}")
    kw = dict(SHAPES[shape], bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    return FAMILIES[family](**kw)


def make_random_checkpoint(path: str, family: str = "llama", shape: str = "tiny", seed: int = 0,
                           dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides) -> str:
    """Save a random-weight model of `family` and `shape` (plus its tokenizer) to `path`. The weights are drawn
    on `device` (an 8B model's init takes minutes on CPU cores, a second on a GPU)."""
    from transformers import AutoModelForCausalLM

    config = make_config(family, shape, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # (the caller's engine sizes its KV pool from the memory left free)
    build_tokenizer(min(512, config.vocab_size)).save_pretrained(path)
    return path


def add_model_arguments(parser, shape: str | None = "100m") -> None:
    """A benchmark's model: --shape (random weights), --checkpoint or --model (a real one instead) and --device.
    With shape None, the benchmark picks its default checkpoint when neither is given."""
    parser.add_argument("--shape", default=shape, choices=sorted(SHAPES), help="model shape (random weights)")
    parser.add_argument("--checkpoint", "--model", dest="checkpoint",
                        help="use this checkpoint directory instead of a random one")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")


def benchmark_model(args, tmp: str, **overrides) -> tuple[str, str]:
    """(checkpoint path, device) for add_model_arguments' args: the --checkpoint given, or a random llama of
    --shape (its config changed by `overrides`) saved under `tmp`, drawn on the device (bf16 on CUDA, fp32 on
    CPU); "auto" picks CUDA when it is visible."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    path = args.checkpoint or make_random_checkpoint(
        tmp, "llama", args.shape, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32, device=device,
        **overrides)
    return path, device

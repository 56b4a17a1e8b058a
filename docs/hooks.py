"""MkDocs hooks (mkdocs.yml `hooks:`): the benchmark plots join the site without being copied into docs/.

Every benchmarks/results/*.png is added as results/plots/<name>.png, so a page under results/ embeds
`plots/<name>.png` and the link checker sees a file that exists.
"""

import glob
import os

from mkdocs.structure.files import File

PLOTS = os.path.join("benchmarks", "results")
SITE_DIR = "results/plots"


def on_files(files, config):
    root = os.path.dirname(config["config_file_path"])
    for path in sorted(glob.glob(os.path.join(root, PLOTS, "*.png"))):
        uri = f"{SITE_DIR}/{os.path.basename(path)}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=path))
    return files

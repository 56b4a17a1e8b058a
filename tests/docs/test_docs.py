"""The documentation site: it builds with warnings as errors (every internal link and anchor checked), its API
reference is what docs/gen_api.py renders from the .proto files, and that reference lists every RPC."""

import glob
import os
import subprocess
import sys

from braid.protos import agent_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    # NO_MKDOCS_2_WARNING: Material for MkDocs' own switch for the end-of-life notice it prints on every build
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "api-reference" / "index.html").is_file()
    # the hook serves every benchmark plot under results/plots/, without a copy in docs/
    plots = glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.png"))
    assert plots
    missing = [os.path.basename(p) for p in plots if not (site / "results" / "plots" / os.path.basename(p)).is_file()]
    assert not missing, missing
    # the build scripts stay out of the site
    assert not list(site.glob("*.py"))


def test_the_api_reference_is_generated_from_the_protos():
    done = subprocess.run([sys.executable, os.path.join("docs", "gen_api.py"), "--check"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_api_reference_lists_every_rpc():
    with open(os.path.join(ROOT, "docs", "api-reference.md"), encoding="utf-8") as f:
        text = f.read()
    service = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
    assert service.methods
    missing = [m.name for m in service.methods if f"| `{m.name}` |" not in text]
    assert not missing, f"RPCs of braid.v1.AgentService missing from docs/api-reference.md: {missing}"

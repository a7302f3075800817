"""Every Python block in README.md and docs/ runs, top to bottom, in a fresh interpreter: the
documentation never lies. README's install command and example run in a fresh virtual environment.

The two shell commands (set up and run the demo; set up and run the tests) are run verbatim by
.ci/run, which extracts them from README.md the same way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The pages README sends users to; their blocks are whole programs (docs/accelerator.md's are
# excerpts of a training loop, not meant to run alone).
DOCUMENTS = [README] + [ROOT / "docs" / name for name in ("usage.md", "coming-from-accelerate.md", "coming-from-lightning.md",
                                                       "several-machines.md")]


def python_blocks(document: Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", document.read_text(), flags=re.S | re.M)


def shell_command_after(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", README.read_text())
    assert match, f"README.md has no bash block after <!-- {marker} -->"
    return match.group(1)


def ipython_blocks() -> list[str]:
    return [block for document in DOCUMENTS
            for block in re.findall(r"^```ipython\n(.*?)^```", document.read_text(), flags=re.S | re.M)]


def test_readme_has_the_two_commands():
    assert "pytest" in shell_command_after("ci:test-command")
    assert "python -m nblaunch demo" in shell_command_after("ci:main-command")


# README's blocks run in the default run; the pages it sends users to, in the slow lane.
@pytest.mark.parametrize("document", [pytest.param(d, id=d.name, marks=() if d == README else pytest.mark.slow)
                                      for d in DOCUMENTS if python_blocks(d)])
def test_every_python_block_of_the_documentation_runs(document, tmp_path):
    script = tmp_path / "blocks.py"
    # One script per document, blocks in order: later blocks may use what earlier ones defined.
    script.write_text("\n\n".join(python_blocks(document)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"{document.name}'s code failed:\n{done.stdout}\n{done.stderr}"


def test_readme_has_its_example():
    assert any("notebook_launcher(train" in block for block in python_blocks())


@pytest.mark.slow
def test_readmes_install_command_and_example_work_in_a_fresh_environment(tmp_path):
    """A new user's path: a bare venv, torch's CPU build, README's install line run as written
    beside this checkout (``./nblaunch``: installed as a package, not in place, so a file left
    out of the package fails here) with its demo, then README's example with nothing else."""
    install = shell_command_after("readme:install")
    assert install.startswith('pip install "./nblaunch[') and "nblaunch demo" in install
    source = tmp_path / "nblaunch"
    source.symlink_to(ROOT)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    # The CPU build README tells laptop users to install first (here: the pin CI uses).
    subprocess.run(["pip", "install", "-q", "torch==2.13.0"], check=True, env=env, timeout=900)
    done = subprocess.run(install, shell=True, env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nblaunch: all 2 ranks done" in done.stdout, done.stdout[-3000:]
    where = subprocess.run(["python", "-c", "import nblaunch; print(nblaunch.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the installed copy, not this checkout
    script = tmp_path / "example.py"
    script.write_text("\n\n".join(python_blocks()))
    done = subprocess.run(["python", str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"README's example failed in a fresh environment:\n{done.stdout}\n{done.stderr}"
    assert "nblaunch: all 2 ranks done" in done.stdout


@pytest.mark.notebooks
def test_the_readmes_notebook_cells_run_in_a_real_kernel(tmp_path):
    """The ``ipython`` blocks (cell magics) are notebook cells: run them in order in a kernel."""
    import nbformat
    from nbclient import NotebookClient

    blocks = ipython_blocks()
    assert any(block.startswith("%%distributed") for block in blocks)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(b.rstrip()) for b in blocks])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    values = [o.data["text/plain"] for c in nb.cells for o in c.outputs if o.output_type == "execute_result"]
    assert values and values[-1].startswith("[") and values[-1].count(",") == 1, values


def test_every_link_to_nblaunchs_home_is_the_one_pyproject_names():
    import tomllib

    home = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    owner_and_name = home.removeprefix("https://github.com/")
    places = [README, ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "notebooks").glob("*.ipynb"),
              *(ROOT / "binder").glob("*")]
    for path in places:
        for found in re.findall(r"(?:github(?:\.com)?|/v2/gh)/([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+?)(?=[/?\"')\s]|\.git|$)",
                                path.read_text(), flags=re.M):
            if found.split("/")[0] in ("pytorch", "huggingface", "Lightning-AI", "ray-project", "python"):
                continue  # other projects' pages, cited
            assert found == owner_and_name, f"{path.name} links to {found}, not to {home}"


def test_every_ratio_readmes_benchmark_table_gives_is_in_a_results_file():
    """README's figures are copied from what a benchmark run wrote, never typed from memory."""
    section = README.read_text().split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"(\d+\.\d+)×", section)
    assert figures
    results = "\n".join(path.read_text() for path in (ROOT / "benchmarks" / "results").rglob("*.md"))
    missing = [f"{figure}×" for figure in figures if f"{figure}x" not in results]
    assert not missing, f"README's {missing} are in no file under benchmarks/results/"

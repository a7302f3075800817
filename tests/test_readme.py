"""Every Python block in README.md runs, top to bottom, in a fresh interpreter: README never lies.

The two shell commands (set up and run the demo; set up and run the tests) are run verbatim by
.ci/run, which extracts them from README.md the same way.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def shell_command_after(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", README.read_text())
    assert match, f"README.md has no bash block after <!-- {marker} -->"
    return match.group(1)


def ipython_blocks() -> list[str]:
    return re.findall(r"^```ipython\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_two_commands():
    assert "pytest" in shell_command_after("ci:test-command")
    assert "python -m nblaunch demo" in shell_command_after("ci:main-command")


def test_every_python_block_in_the_readme_runs(tmp_path):
    blocks = python_blocks()
    assert blocks, "README.md has no python blocks"
    script = tmp_path / "readme_blocks.py"
    # One script, blocks in order: later blocks may use what earlier ones defined.
    script.write_text("\n\n".join(blocks))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"README code failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
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

"""Every Python block in README.md runs, top to bottom, in a fresh interpreter: README never lies.

The two shell commands (set up and run the demo; set up and run the tests) are run verbatim by
.ci/run, which extracts them from README.md the same way.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def shell_command_after(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", README.read_text())
    assert match, f"README.md has no bash block after <!-- {marker} -->"
    return match.group(1)


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

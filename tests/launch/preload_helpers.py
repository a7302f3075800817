"""For the preloading tests: packages really installed (in this interpreter's site-packages,
where the ranks' imports come from), and scenarios run in a fresh Jupyter kernel each (what a
kernel imported for its ranks is kept per process: ``#%%`` in a scenario starts a new cell), or
as a script in a fresh interpreter (``run_script``)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import uuid

HEADER = textwrap.dedent("""
    import json, os, sys, time
    import nblaunch
    from nblaunch import notebook_launcher

    def say(**values):
        print("RESULT " + json.dumps(values), flush=True)

    def launch(function, *args, n=1, method=None, **options):
        return notebook_launcher(function, args=args, num_processes=n, start_method=method, display="none",
                                 timeout=120, **options)
""")


class Installed:
    """Packages written into site-packages for one test, removed after it."""

    def __init__(self) -> None:
        self.site = sysconfig.get_paths()["purelib"]
        self._made: list[str] = []

    def package(self, source: str, name: str | None = None) -> str:
        """A package whose ``__init__.py`` is ``source``; its (fresh) name."""
        name = name or f"nbl_warm_{uuid.uuid4().hex[:10]}"
        folder = os.path.join(self.site, name)
        os.makedirs(folder, exist_ok=True)
        self.rewrite(name, source)
        self._made.append(folder)
        return name

    def rewrite(self, name: str, source: str) -> None:
        """Install ``name`` anew with ``source``: a new file, as pip writes one."""
        path = os.path.join(self.site, name, "__init__.py")
        with open(path + ".new", "w") as new:
            new.write(textwrap.dedent(source))
        os.replace(path + ".new", path)
        importlib.invalidate_caches()

    def remove(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.site, name), ignore_errors=True)

    def clean(self) -> None:
        for folder in self._made:
            shutil.rmtree(folder, ignore_errors=True)


def run(script: str, cwd: str, setup: str = "", timeout: float = 300, cells: bool = False,
        **environ: str):
    """Run HEADER, ``setup`` and ``script`` (cells split at ``#%%``) in a fresh kernel; every
    ``say(...)`` it printed, and everything else it printed (stderr and stdout, in order).
    ``cells``: what each cell printed instead (the first is HEADER's and ``setup``'s)."""
    import nbformat
    from nbclient import NotebookClient

    sources = [HEADER + textwrap.dedent(setup)] + [textwrap.dedent(c) for c in textwrap.dedent(script).split("#%%")]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in sources if c.strip()])
    saved = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)  # the kernel's environment is this process's
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": cwd}}).execute()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    shown = []
    for cell in notebook.cells:
        for output in cell.outputs:
            if output.output_type == "error":
                raise AssertionError(f"a cell failed: {output.ename}: {output.evalue}\n" + "\n".join(output.traceback))
        shown.append("".join(output.get("text", "") for output in cell.outputs))
    if cells:
        return shown
    text = "".join(shown)
    said = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    return said, text


def run_script(script: str, cwd: str, setup: str = "", timeout: float = 300) -> tuple[list[dict], str]:
    """Run HEADER, ``setup`` and ``script`` (its ``#%%`` marks mean nothing there) as a script in
    a fresh interpreter; every ``say(...)`` it printed, and its stderr."""
    source = HEADER + textwrap.dedent(setup) + "\n" + textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", source], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    said = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return said, done.stderr

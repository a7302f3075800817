"""For the warm-start tests: packages really installed (in this interpreter's site-packages,
where the ranks' imports come from), and scripts run in fresh interpreters (a kernel's warm
start is kept per process: each scenario starts from none)."""

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


def run(script: str, cwd: str, setup: str = "", timeout: float = 300, **environ: str) -> tuple[list[dict], str]:
    """Run HEADER, ``setup`` and ``script`` in a fresh interpreter; every ``say(...)`` it
    printed, and its stderr."""
    env = dict(os.environ, **environ)
    code = HEADER + textwrap.dedent(setup) + "\n" + textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    said = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return said, done.stderr

"""Reading a notebook cell run by nbclient, for the tests that execute notebooks."""

from __future__ import annotations


def everything_shown(cell) -> str:
    """All the text of a cell's outputs, as a saved notebook holds it: streams, errors with
    their tracebacks, and every representation of displayed and returned values."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts += [output.ename, output.evalue, *output.traceback]
        else:
            parts += [str(v) for v in output.get("data", {}).values()]
    return "\n".join(parts)

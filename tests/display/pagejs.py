"""Conditions evaluated in a JupyterLab page by the browser tests."""

KERNEL_IDLE = (
    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
    " && window.jupyterapp.shell.currentWidget.sessionContext"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'"
)

"""Ranks on several machines through a cluster engine (Ray): ``notebook_launcher(..., cluster="ray")``.

Imported only when a launch asks for a cluster; Ray itself only inside ``placement``.
"""

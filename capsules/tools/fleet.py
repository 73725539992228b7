"""The fleet-wide catalogue: this node's tools, then every other live node's (sans-IO).

With ``[fleet]`` the supervisor (sage/fleet/tools.py) reads each live node's
catalogue from the ``sage_tools`` bucket and hands the bridge
``sage.v1.tools.fleet`` ``{"node": <this node>, "nodes": {<node>: [tool, ...]}}``.
:class:`FleetCatalogue` keeps the local :class:`~capsules.tools.catalogue.Catalogue`
as it was and adds the remote tools under it: each remote tool passes the same
checks as a local one (name, description, schema, sizes), at most
:data:`MAX_REMOTE_TOOLS` per node.  A local tool always wins its name; between
two remote nodes the one whose name sorts first wins, so every node resolves a
clash the same way.  Each tool not in force is a clash row
(``{"name", "capsule", "node", "owner", "owner_node"}``; on a single host the
local rows stay ``{"name", "capsule", "owner"}``), as ``tools list`` shows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from capsules.tools.catalogue import Catalogue, Change, Rejection, Tool, valid_name

__all__ = ("MAX_REMOTE_TOOLS", "FleetCatalogue")

MAX_REMOTE_TOOLS = 1024
"""Tools taken from one remote node's catalogue; the rest are dropped (one rejection)."""


class FleetCatalogue(Catalogue):
    """The local catalogue plus the other nodes' tools (a local tool wins its name)."""

    def __init__(self) -> None:
        super().__init__()
        self.node = ""
        """This node's name, once the supervisor said it ("" on a single host)."""
        self._remote: dict[str, dict[str, Tool]] = {}
        """node -> its valid tools by name, nodes sorted."""

    # -- reading ----------------------------------------------------------

    def get(self, name: str) -> Tool | None:
        local = super().get(name)
        return local if local is not None else self._remote_owner(name)

    def tools(self) -> list[Tool]:
        local = {tool.name: tool for tool in super().tools()}
        for node in self._remote:
            for name, tool in self._remote[node].items():
                local.setdefault(name, tool)
        return [local[name] for name in sorted(local)]

    def clashes(self) -> list[dict[str, str]]:
        rows = super().clashes()
        if self.node:  # in a fleet: the local clashes say where, too
            rows = [{**row, "node": self.node, "owner_node": self.node} for row in rows]
        for node, offered in self._remote.items():
            for name, tool in offered.items():
                owner = self.get(name)
                if owner is not None and owner is not tool:
                    rows.append(
                        {
                            "name": name,
                            "capsule": tool.capsule,
                            "node": node,
                            "owner": owner.capsule,
                            "owner_node": owner.node or self.node,
                        }
                    )
        return sorted(rows, key=lambda row: (row["name"], row.get("node", ""), row["capsule"]))

    def remote_nodes(self) -> list[str]:
        return list(self._remote)

    # -- changing ---------------------------------------------------------

    def set_remote(self, node: str, nodes: Any) -> Change:
        """Replace every remote node's tools with ``nodes`` (``{node: [tool, ...]}``)."""
        if isinstance(node, str) and valid_name(node):
            self.node = node
        if not isinstance(nodes, dict):
            reason = 'a fleet catalogue must be {"nodes": {node: [tools]}}; it was ignored'
            return Change(rejected=[Rejection("fleet", None, reason)])
        before = self._snapshot()
        remote: dict[str, dict[str, Tool]] = {}
        rejected: list[Rejection] = []
        for name in sorted(n for n in nodes if isinstance(n, str)):
            if not valid_name(name) or name == self.node:
                rejected.append(Rejection(f"node:{name[:64]}", None, "not another node's name"))
                continue
            remote[name] = self._node_tools(name, nodes[name], rejected)
        self._remote = remote
        return Change(self._diff(before), rejected)

    def _node_tools(self, node: str, entries: Any, rejected: list[Rejection]) -> dict[str, Tool]:
        where = f"node:{node}"
        if not isinstance(entries, list):
            rejected.append(Rejection(where, None, "its catalogue is not a list: ignored"))
            return {}
        offered: dict[str, Tool] = {}
        for entry in entries[:MAX_REMOTE_TOOLS]:
            capsule = entry.get("capsule") if isinstance(entry, dict) else None
            if not valid_name(capsule):
                rejected.append(Rejection(where, None, "a tool without a valid capsule name"))
                continue
            assert isinstance(capsule, str)
            tool = self._check(capsule, entry, offered, rejected)
            if tool is not None:
                offered[tool.name] = replace(tool, node=node)
        if len(entries) > MAX_REMOTE_TOOLS:
            reason = f"{len(entries)} tools, over the cap of {MAX_REMOTE_TOOLS}: the rest dropped"
            rejected.append(Rejection(where, None, reason))
        return offered

    def _remote_owner(self, name: str) -> Tool | None:
        for offered in self._remote.values():  # nodes sorted: the first name wins
            tool = offered.get(name)
            if tool is not None:
                return tool
        return None

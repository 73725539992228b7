"""The impl lint run before ``forge_tool`` succeeds (pure).

The static check is a lint, the sandbox is the wall: it refuses code that
plainly asks for what its persona may not have, so the author learns at
forge time rather than from a sandbox error.

python: the source must parse (``ast.parse``); every ``import x``, ``from x
import y``, ``__import__("x")`` and ``importlib.import_module("x")`` with a
literal name is collected.  :data:`ALWAYS_FORBIDDEN` (``ctypes``, ``cffi``,
``_ctypes``: raw memory and syscalls, which nothing a tool does needs) is
refused for everyone; :data:`NETWORK_MODULES` only when the persona's
sandbox has no network (the import would fail or be useless there anyway).
``subprocess`` and ``os.system`` are allowed: whatever they start runs in
the same sandbox, under the same limits.

bash: only an empty (all-whitespace) script is refused; shell cannot be
checked statically in any useful way, the sandbox contains it.
"""

from __future__ import annotations

import ast

from sage.errors import ForgeError

__all__ = ("ALWAYS_FORBIDDEN", "NETWORK_MODULES", "check_impl", "imported_modules")

ALWAYS_FORBIDDEN = frozenset({"ctypes", "_ctypes", "cffi"})
NETWORK_MODULES = frozenset(
    {
        "socket",
        "_socket",
        "ssl",
        "http",
        "urllib",
        "urllib3",
        "ftplib",
        "smtplib",
        "poplib",
        "imaplib",
        "telnetlib",
        "nntplib",
        "xmlrpc",
        "socketserver",
        "asyncio",
        "requests",
        "httpx",
        "aiohttp",
        "websocket",
        "websockets",
    }
)


def imported_modules(source: str) -> set[str]:
    """Top-level names of every module the source imports (raises SyntaxError)."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                found.add(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            first = node.args[0]
            if dynamic and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
    return {name.split(".", 1)[0] for name in found if name}


def check_impl(runtime: str, impl: str, *, network: bool) -> None:
    """Raise ``ForgeError("static_check_failed")`` when ``impl`` may not be forged."""
    if not impl.strip():
        raise ForgeError("static_check_failed", "impl is empty")
    if runtime != "python":
        return
    try:
        modules = imported_modules(impl)
    except (SyntaxError, ValueError) as exc:
        raise ForgeError("static_check_failed", f"impl does not parse: {exc}") from None
    bad = sorted(modules & ALWAYS_FORBIDDEN)
    if not network:
        bad += sorted(modules & NETWORK_MODULES)
    if bad:
        why = "" if network else " (this persona has no network)"
        raise ForgeError("static_check_failed", f"impl imports forbidden modules{why}: {bad}")

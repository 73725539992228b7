"""docs/topics.md stays honest about the session runner.

The runner's section of the doc ("### Session runner" in part 1) must name
every pattern of ``capsules/runner/Capsule.toml``, every field of the
payload Structs in ``capsules/runner/messages.py`` (and of the requests the fleet
sends it, sage/contract/sessions.py) and every error code the
runner's code can answer with; and every topic its ``pub``/``sub`` rows list
must be allowed by the manifest.  ``<sid>``, ``<cid>``, ``<name>`` in the
doc stand for one token, like ``*`` in a pattern.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from bus.acl import pattern_covers
from capsules.runner import messages
from sage.capsule.manifest import load_manifest
from sage.contract import sessions as contract
from sage.contract.codes import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "topics.md"
RUNNER = ROOT / "capsules" / "runner"

_PLACEHOLDER = re.compile(r"<[A-Za-z_]+>")
_CODE = re.compile(r"`([^`\n]+)`")
_ROW = re.compile(r"^\|\s*(pub|sub)\s*\|\s*`([^`]+)`", re.MULTILINE)


def runner_section(text: str) -> str:
    """The "### Session runner" section of part 1 (up to the next ## or ### heading)."""
    implemented = text.split("\n## 2.", 1)[0]
    match = re.search(r"^### Session runner\b.*?(?=^##?#? )", implemented + "\n## end", re.S | re.M)
    assert match, "docs/topics.md has no '### Session runner' section in part 1"
    return match.group(0)


def normalise(topic: str) -> str:
    """A documented topic as a pattern: each ``<placeholder>`` token becomes ``*``."""
    return _PLACEHOLDER.sub("*", topic)


def documented_patterns(section: str) -> set[str]:
    """Everything in backticks that reads as a topic or pattern, normalised."""
    found = set()
    for code in _CODE.findall(section):
        for part in re.split(r"[,\s]+", code):
            if "." in part and re.fullmatch(r"[A-Za-z0-9_<>*.-]+", part):
                found.add(normalise(part))
    return found


RUNNER_REQUESTS_OF_THE_CONTRACT = ("AdoptRequest", "YieldRequest")
"""The requests the runner takes from the fleet, defined in sage/contract/sessions.py."""


def struct_fields() -> dict[str, list[str]]:
    """Wire names of the fields of every Struct ``messages`` exports, and of the runner's
    requests the contract defines."""
    out = {}
    for name in (*messages.__all__, *RUNNER_REQUESTS_OF_THE_CONTRACT):
        cls = getattr(messages, name, None) or getattr(contract, name)
        assert issubclass(cls, msgspec.Struct)
        out[name] = [f.encode_name for f in msgspec.structs.fields(cls)]
    return out


def field_problems(section: str, struct: str) -> list[str]:
    """What is wrong with how ``section`` lists ``struct``'s fields (empty: nothing)."""
    lines = [line for line in section.splitlines() if f"`{struct} {{" in line]
    if not lines:
        return [f"{struct} is not named as `{struct} {{...}}`"]
    problems = []
    for line in lines:
        braces = re.search(rf"`{struct} \{{([^}}]*)\}}`", line)
        if braces is None:
            problems.append(f"{struct}: no {{fields}} after its name")
            continue
        listed = {f.strip().rstrip("?") for f in braces.group(1).split(",")} - {""}
        fields = struct_fields()[struct]
        problems += [f"{struct}.{f} is not listed" for f in fields if f not in listed]
        problems += [f"{struct} has no field {f!r}" for f in sorted(listed - set(fields))]
    return problems


def error_codes() -> set[str]:
    """Codes the runner answers with: ``SessionError("x", ...)``, ``_reject(_, _, "x", ...)``
    and ``ErrorCode.X`` (an admission's refusal, capsules/runner/admission.py)."""
    codes = set()
    for path in RUNNER.glob("*.py"):
        source = path.read_text()
        codes |= set(re.findall(r"SessionError\(\s*\"([a-z_]+)\"", source))
        codes |= set(re.findall(r"_reject\(\s*(?:\w+,\s*)+\"([a-z_]+)\"", source))
        codes |= {ErrorCode[name].value for name in re.findall(r"ErrorCode\.([A-Z_]+)", source)}
    return codes


@pytest.fixture(scope="module")
def section() -> str:
    return runner_section(DOC.read_text())


def test_every_manifest_pattern_is_documented(section: str) -> None:
    manifest = load_manifest(RUNNER)
    documented = documented_patterns(section)
    missing = [
        pattern
        for pattern in (*manifest.publish.patterns, *manifest.subscribe.patterns)
        if pattern not in documented
    ]
    assert not missing, f"docs/topics.md (Session runner) does not name {missing}"


def test_every_documented_row_is_allowed_by_the_manifest(section: str) -> None:
    manifest = load_manifest(RUNNER)
    allowed = {"pub": manifest.publish.patterns, "sub": manifest.subscribe.patterns}
    rows = _ROW.findall(section)
    assert len(rows) >= 20, "the runner's topic tables went missing"
    outside = [
        f"{direction} {topic}"
        for direction, topic in rows
        if not any(pattern_covers(p, normalise(topic)) for p in allowed[direction])
    ]
    assert not outside, f"documented but not in Capsule.toml: {outside}"


@pytest.mark.parametrize("struct", sorted(struct_fields()))
def test_every_struct_field_is_documented(section: str, struct: str) -> None:
    assert not field_problems(section, struct)


def test_every_error_code_is_documented(section: str) -> None:
    codes = error_codes()
    assert {"not_authorized", "principal_limit", "unknown_session"} <= codes, codes
    missing = sorted(code for code in codes if f"`{code}`" not in section)
    assert not missing, f"error codes not in docs/topics.md: {missing}"


def test_the_checks_can_fail(section: str) -> None:
    """A dropped or invented field, a renamed pattern and a missing section are seen."""
    assert field_problems(section.replace("{text, session_id?}", "{text}"), "SendRequest") == [
        "SendRequest.session_id is not listed"
    ]
    assert field_problems(
        section.replace("{allowed, reason?}", "{allowed, why}"), "ApprovalResponse"
    )
    assert field_problems(section.replace("`ToolsList {tools}`", "`ToolsList`"), "ToolsList")
    renamed = section.replace("approval.v1.response", "approval.v1.answer")
    assert "approval.v1.response.*" in documented_patterns(section)
    assert "approval.v1.response.*" not in documented_patterns(renamed)
    with pytest.raises(AssertionError):
        runner_section(DOC.read_text().replace("### Session runner\n", "### Runner\n", 1))

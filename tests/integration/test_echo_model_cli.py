"""`make standin`'s command (python -m tests.support.echo_model): it prints its URL,
answers a Messages request, and says clearly when it cannot listen."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COMMAND = [sys.executable, "-m", "tests.support.echo_model"]


def test_it_prints_its_url_and_echoes_a_prompt() -> None:
    proc = subprocess.Popen(
        [*COMMAND, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            f"{url}/v1/messages", data=json.dumps(body).encode(), method="POST"
        )
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as answer:
            message = json.loads(answer.read())
        assert [b["text"] for b in message["content"]] == ["echo: hi"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "ANTHROPIC_BASE_URL" in err  # it says how to point sessions at it


def test_a_port_in_use_is_one_clear_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*COMMAND, "--port", str(port)], capture_output=True, text=True, timeout=20, cwd=ROOT
        )
    assert done.returncode == 1
    assert done.stderr.startswith(f"echo_model: cannot listen on 127.0.0.1:{port}:"), done.stderr
    assert "Traceback" not in done.stderr

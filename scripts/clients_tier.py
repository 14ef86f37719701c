"""The agents' own CLIs against `spark serve` (issue 39), run by scripts/test_clients.

Installs the pinned npm packages (Claude Code, Codex CLI) into $SPARK_HOME/clients, starts
`spark serve` on a model (default: the tests' demo model), puts a pass-through recorder in front
of it (it forwards every request and notes its path, status and what it carried), and runs each
CLI non-interactively in a temp dir holding notes.txt:

- chat: a plain answer (Claude Code `-p --output-format json`, Codex `exec`);
- stream: a streamed answer (Claude Code `--output-format stream-json`, Codex `exec --json`);
- tool: one tool round trip (Claude Code's Read, Codex's exec_command `cat`): a request that
  carries the tool's result answered 200.

`connect` is the first request answered 200. The prompts are kept small (Claude Code `--bare`
with a one-line `--system-prompt` and `--tools Read`; Codex with one-line model instructions):
the demo model reads ~20 tokens/s on 2 cores. `--full` sends the CLIs' own prompts (Claude Code's
is ~17,500 tokens: give `-c` room). Prints a table client x (connect, chat, stream, tool).
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINNED = {"claude": ("@anthropic-ai/claude-code", "2.1.197"), "codex": ("@openai/codex", "0.171.0")}
SYSTEM = "You are a coding agent. Answer briefly. Use a tool when asked to read a file."
NOTE = "The secret word is pineapple."
COLUMNS = ("connect", "chat", "stream", "tool")
MAX_OUTPUT = 256  # tokens an answer may take (Codex sends no limit: spark serve -n; Claude Code's own setting)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(prefix: Path) -> dict[str, Path]:
    """The pinned CLIs (npm install once into `prefix`); their executables."""
    bins = {name: prefix / "node_modules" / ".bin" / name for name in PINNED}
    pkgs = [f"{pkg}@{ver}" for pkg, ver in PINNED.values()]
    have = {}
    for name, (pkg, _) in PINNED.items():
        manifest = prefix / "node_modules" / pkg / "package.json"
        have[name] = json.loads(manifest.read_text())["version"] if manifest.is_file() else None
    if any(have[n] != PINNED[n][1] for n in PINNED):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), *pkgs], check=True)
    return bins


# ---------------------------------------------------------------- the recorder


@dataclass
class Seen:
    path: str
    status: int
    tool_result: bool  # the body carried a tool's result (tool_result / function_call_output)


@dataclass
class Recorder:
    upstream: int
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def start(self) -> "Recorder":
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                up = http.client.HTTPConnection("127.0.0.1", rec.upstream, timeout=3600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")}
                up.request(self.command, self.path, body=body or None, headers=headers)
                r = up.getresponse()
                text = body.decode("utf-8", "replace")
                rec.seen.append(Seen(self.path, r.status, '"tool_result"' in text or '"function_call_output"' in text))
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := r.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.close_connection = True

            do_GET = do_POST = do_HEAD = _forward

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def since(self, n: int) -> list[Seen]:
        return self.seen[n:]


# ---------------------------------------------------------------- the CLIs


def claude(exe: Path, url: str, home: Path, prompt: str, full: bool, *extra: str) -> list[str]:
    small = [] if full else ["--bare", "--system-prompt", SYSTEM, "--tools", "Read"]
    return [str(exe), "-p", prompt, *small, *extra]


def codex(exe: Path, url: str, home: Path, prompt: str, full: bool, *extra: str) -> list[str]:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    instructions = home / "instructions.md"
    instructions.write_text(SYSTEM + "\n")
    config.write_text(f'model = "spark"\nmodel_provider = "spark"\n[model_providers.spark]\nname = "spark"\n'
                      f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "SPARK_CLIENT_KEY"\n')
    small = [] if full else ["-c", f"model_instructions_file={instructions}", "-c", "web_search=disabled",
                             "-c", "include_permissions_instructions=false",
                             "-c", "include_environment_context=false"]
    return [str(exe), "exec", "--skip-git-repo-check", "--ephemeral", *small, *extra, prompt]


def env_for(name: str, url: str, home: Path) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home)}
    if name == "claude":  # NOTE: Claude Code asks for 32,000-64,000 tokens: a tiny model may ramble that long
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="spark", DISABLE_AUTOUPDATER="1",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_OUTPUT))
    else:
        env.update(CODEX_HOME=str(home / ".codex"), SPARK_CLIENT_KEY="spark")
    return env


SCENARIOS = {
    "claude": {"chat": ("Say hello in five words.", ("--output-format", "json")),
               "stream": ("Say hello in five words.", ("--output-format", "stream-json", "--verbose")),
               "tool": ("Use the Read tool to read notes.txt, then tell me the secret word.",
                        ("--allowedTools", "Read"))},
    "codex": {"chat": ("Say hello in five words.", ()),
              "stream": ("Say hello in five words.", ("--json",)),
              "tool": ("Run `cat notes.txt` and tell me the secret word.", ())},
}


def answered(name: str, scenario: str, out: str) -> bool:
    """Whether the CLI printed an answer (and, streamed, as a stream of events)."""
    if name == "claude" and scenario == "chat":
        try:
            result = json.loads(out)
        except json.JSONDecodeError:
            return False
        return not result.get("is_error") and bool(str(result.get("result", "")).strip())
    if scenario == "stream":
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return len(events) > 1 and not any(e.get("is_error") or e.get("type") == "error" for e in events)
    return bool(out.strip())


@dataclass
class Cell:
    ok: bool | None = None  # None: not run
    note: str = ""

    def __str__(self) -> str:
        mark = "-" if self.ok is None else "ok" if self.ok else "FAIL"
        return f"{mark} {self.note}".strip()


def run_client(name: str, exe: Path, rec: Recorder, work: Path, full: bool, timeout: float) -> dict[str, Cell]:
    url = f"http://127.0.0.1:{rec.port}"
    row = {c: Cell() for c in COLUMNS}
    build = claude if name == "claude" else codex
    for scenario, (prompt, extra) in SCENARIOS[name].items():
        home = Path(tempfile.mkdtemp(prefix=f"spark-{name}-"))
        n = len(rec.seen)
        t0 = time.monotonic()
        try:
            p = subprocess.run(build(exe, url, home, prompt, full, *extra), cwd=work, env=env_for(name, url, home),
                               capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            out, rc, said = p.stdout, p.returncode, (p.stderr.strip() or p.stdout.strip()).splitlines()
        except subprocess.TimeoutExpired as e:
            out, rc, said = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), -1, []
        wall = time.monotonic() - t0
        why = f": {said[-1][:80]}" if rc not in (0, -1) and said else ""
        seen = [s for s in rec.since(n) if s.path.split("?")[0] not in ("/", "/v1/models")]
        statuses = sorted({s.status for s in seen})
        if row["connect"].ok is None and seen:
            row["connect"] = Cell(any(s.status == 200 for s in seen), f"HTTP {statuses}")
        if scenario == "tool":
            back = [s for s in seen if s.tool_result]
            ok = bool(back) and all(s.status == 200 for s in back)
            ended = "" if rc == 0 else f", rc {rc}{why}"
            row["tool"] = Cell(ok, f"{len(back)} result(s) sent back, {wall:.0f} s{ended}")
        else:
            ok = rc == 0 and bool(seen) and all(s.status == 200 for s in seen) and answered(name, scenario, out)
            row[scenario] = Cell(ok, f"HTTP {statuses}, {wall:.0f} s" + ("" if rc == 0 else f", rc {rc}{why}"))
        shutil.rmtree(home, ignore_errors=True)
        print(f"{name} {scenario}: {row[scenario] if scenario != 'tool' else row['tool']}", flush=True)
    return row


# ---------------------------------------------------------------- the server


def start_server(model: Path, ctx: int, threads: int, parallel: int, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [str(REPO / ".venv" / "bin" / "spark"), "serve", str(model), "-c", str(ctx), "-np", str(parallel),
            "-t", str(threads), "-n", str(MAX_OUTPUT), "--port", str(port), "--no-learn"]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"spark serve exited {proc.returncode}: see {log}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"spark serve did not become ready: see {log}")


def demo_model() -> Path:
    sys.path.insert(0, str(REPO))
    from spark_cli.models.demo_model import build_demo_model

    return build_demo_model(n_expert=8, n_expert_used=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF to serve (default: the tests' demo model)")
    ap.add_argument("-c", "--ctx-size", type=int, default=8192, help="spark serve -c (default 8192)")
    ap.add_argument("-np", "--parallel", type=int, default=1, help="spark serve -np (default 1)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="spark serve -t (default 2)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per CLI run (default 1800)")
    ap.add_argument("--full", action="store_true", help="the CLIs' own (long) prompts and every tool")
    ap.add_argument("--only", choices=sorted(PINNED), action="append", help="run this client only (repeatable)")
    args = ap.parse_args()
    home = Path(os.environ.get("SPARK_HOME", Path.home() / ".cache" / "spark"))
    bins = install(home / "clients")
    model = args.model or demo_model()
    work = Path(tempfile.mkdtemp(prefix="spark-clients-"))
    (work / "notes.txt").write_text(NOTE + "\n")
    log = work / "serve.log"
    proc, port = start_server(model, args.ctx_size, args.threads, args.parallel, log)
    rows: dict[str, dict[str, Cell]] = {}
    try:
        rec = Recorder(port).start()
        for name in args.only or sorted(PINNED):
            rows[name] = run_client(name, bins[name], rec, work, args.full, args.timeout)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\nspark serve {model.name} -c {args.ctx_size} -np {args.parallel} (log: {log})")
    print(f"{'client':<34}" + "".join(f"{c:<34}" for c in COLUMNS))
    for name, row in rows.items():
        pkg, ver = PINNED[name]
        print(f"{pkg + ' ' + ver:<34}" + "".join(f"{str(row[c]):<34}" for c in COLUMNS))
    return 0 if all(cell.ok for row in rows.values() for cell in row.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

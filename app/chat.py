"""``kvmesh chat``: an interactive multi-turn chat with a running stack.

Every turn sends the whole conversation, so the router can reuse the KV of its history (the footer shows how
many prompt tokens were cached). ``/reset`` starts over, ``/quit`` or EOF exits, Ctrl-C during a reply cancels
just that reply (it is then left out of the history).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TextIO

from kvmesh import state
from kvmesh.client import (
    Completion,
    CompletionBuilder,
    DeadlineExceeded,
    KvmeshClient,
    KvmeshError,
    Unavailable,
)

HELP = "kvmesh chat: /reset clears the conversation, /quit exits, Ctrl-C stops a reply"
NOT_RUNNING = "start a stack with `kvmesh up` (or pass --target / --state-dir)"


def run_chat(client: KvmeshClient, system: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
             stream_out: TextIO | None = None, stream_in: TextIO | None = None) -> int:
    """Run the chat loop on ``stream_in`` / ``stream_out`` (default: stdin / stdout) until ``/quit`` or EOF;
    returns the exit status (0)."""
    out = sys.stdout if stream_out is None else stream_out
    src = sys.stdin if stream_in is None else stream_in
    dim = out.isatty() and "NO_COLOR" not in os.environ

    def say(line: str) -> None:
        out.write((f"\x1b[2m{line}\x1b[0m" if dim else line) + "\n")

    say(HELP)
    history: list[dict[str, str]] = []
    while (line := _read_line(src, out)) is not None:
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            history.clear()
            say("[conversation cleared]")
        elif text.startswith("/"):
            say(f"unknown command {text}; " + HELP.split(": ", 1)[1])
        elif text:
            system_turn = [{"role": "system", "content": system}] if system else []
            user_turn = {"role": "user", "content": text}
            done = _reply(client, system_turn + history + [user_turn], max_tokens, temperature, out, say)
            if done is not None:
                history += [user_turn, {"role": "assistant", "content": done.text}]
    return 0


def _reply(client: KvmeshClient, messages: list[dict[str, str]], max_tokens: int, temperature: float,
           out: TextIO, say: Callable[[str], object]) -> Completion | None:
    """Stream one reply to ``out``; the finished completion, or None when it failed or was cancelled."""
    builder = CompletionBuilder()
    stream = None
    try:
        stream = client.generate(messages=messages, max_tokens=max_tokens, temperature=temperature)
        for chunk in stream:
            builder.add(chunk)
            out.write(chunk.text)
            out.flush()
    except KeyboardInterrupt:
        if stream is not None:
            stream.cancel()
        out.write("\n")
        say("[reply cancelled; not kept in the conversation]")
        return None
    except KvmeshError as e:
        out.write("\n")
        say(f"error: {e}" + (f"; {NOT_RUNNING}" if isinstance(e, Unavailable) else ""))
        return None
    done = builder.build(stream.trailing_metadata)
    out.write("\n")
    say(_footer(done))
    return done


def _footer(done: Completion) -> str:
    u = done.usage
    tokens = u.completion_tokens if u else len(done.token_ids)
    cached = f"{u.cached_tokens}/{u.prompt_tokens} prompt tokens cached" if u else "cache use unknown"
    ttft = f"TTFT {done.ttft_s * 1000:.0f} ms" if done.ttft_s is not None else "no tokens"
    return f"[{tokens} tokens · {cached} · {ttft} · {done.finish_reason or 'unfinished'}]"


def _read_line(stream_in: TextIO, stream_out: TextIO) -> str | None:
    """The next line the user typed, or None at EOF or Ctrl-C."""
    try:
        if stream_in is sys.stdin and stream_out is sys.stdout and stream_in.isatty():
            return input("> ")                  # line editing and history through readline
        stream_out.write("> ")
        stream_out.flush()
        line = stream_in.readline()
        return line if line else None
    except (EOFError, KeyboardInterrupt):
        stream_out.write("\n")
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh chat",
                                description="Interactive multi-turn chat with a running stack.")
    p.add_argument("--state-dir", help="state dir of the stack (default: $KVMESH_STATE_DIR, else ./.kvmesh)")
    p.add_argument("--target", help="router gRPC host:port, or several comma-separated (router replicas: a call "
                                    "fails over to the next, a cut reply resumes there; default: every router "
                                    "in the state dir's stack.json)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("KVMESH_ROUTER_API_KEY"),
                   help="default: $KVMESH_ROUTER_API_KEY (the router's key without a tenant)")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.temperature < 0:
        p.error("--max-tokens must be >= 1 and --temperature >= 0")
    try:
        targets = ([t.strip() for t in args.target.split(",") if t.strip()] if args.target else
                   state.StackInfo.read(state.state_dir(args.state_dir)).router_grpcs)
    except FileNotFoundError as e:
        print(f"kvmesh chat: {e}", file=sys.stderr)
        return 1
    if not targets:
        p.error("--target needs a host:port")
    with KvmeshClient(targets, api_key=args.api_key) as client:
        try:
            health = client.health(timeout_s=5)
        except (Unavailable, DeadlineExceeded):
            print(f"kvmesh chat: no kvmesh router answers at {', '.join(targets)}; {NOT_RUNNING}", file=sys.stderr)
            return 1
        except KvmeshError as e:
            print(f"kvmesh chat: {e}", file=sys.stderr)
            return 1
        if not health.ok:
            print("kvmesh chat: the router is up, but no prefill/decode instance is ready yet",
                  file=sys.stderr)
        return run_chat(client, args.system, args.max_tokens, args.temperature)


if __name__ == "__main__":
    sys.exit(main())

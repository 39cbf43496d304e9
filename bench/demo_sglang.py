"""``make demo-sglang``: pd-router in front of real SGLang 0.5.23 servers on the CPU.

Starts a colocated SGLang server (the reference) and a 2P2D of real SGLang servers with real KV
transfer (mooncake over TCP; the second prefill and decode through server_patch), then a
pd-router process in front of the 2P2D. It sends prompts through the router and checks every
answer token for token against the colocated server, then converts a decode to prefill and back
through the router while clients keep sending, and prints what happened: requests, failures,
token checks, each conversion's phases. Exits 1 on any failed request or different token.

The CPU recipe and the shims it needs are test support (tests/sglang_cpu/, docs/real-sglang.md).
The first run builds SGLang's venv (make sglang-venv: about 11 GB, 3-5 minutes); starting the
five servers takes 1.5-3 minutes on 2 cores.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.cli_process import PD_ROUTER, run, serving  # noqa: E402
from tests.sglang_cluster import (  # noqa: E402
    NO_RADIX,
    SGLangServer,
    missing,
    pd_args,
    router_ready,
    running,
    server,
)

PROMPTS = (
    "The prefill computes the prompt's KV cache",
    "and the decode receives it over mooncake",
    "before generating one token per step,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)
GREEDY = {"temperature": 0, "max_new_tokens": 12}
CLIENTS = 2


def generate(url: str, prompt: str) -> dict:
    reply = httpx.post(
        url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=120.0
    )
    reply.raise_for_status()
    return reply.json()


class Traffic:
    """Clients sending the prompts in turn until stopped, each answer checked."""

    def __init__(self, url: str, expected: dict[str, list[int]]) -> None:
        self.url, self.expected = url, expected
        self.stop = threading.Event()
        self.sent = self.failed = self.different = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def _client(self, index: int) -> None:
        n = index
        while not self.stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                same = generate(self.url, prompt)["output_ids"] == self.expected[prompt]
                failed = False
            except httpx.HTTPError as exc:
                print(f"   request failed: {exc}")
                same, failed = True, True
            with self.lock:
                self.sent += 1
                self.failed += failed
                self.different += not same

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def convert(router: str, target: SGLangServer, role: str) -> dict:
    """``pd-router convert`` as an operator types it; the router's record of the conversion."""
    result = run(PD_ROUTER, "convert", target.url, "--to", role, "--router", router, timeout=300)
    print("   " + "\n   ".join(result.stdout.strip().splitlines()[-2:]))
    if result.returncode != 0:
        raise SystemExit(f"convert failed: {result.stdout}{result.stderr}")
    records = httpx.get(router + "/conversions", timeout=10).json()["conversions"]
    return next(r for r in records if r["worker_url"] == target.url)


def phases(record: dict) -> str:
    timings = record["timings"]
    names = ("drain_s", "switch_s", "verify_s", "canary_s", "total_s")
    return ", ".join(f"{n[:-2]} {timings[n]:.2f} s" for n in names if n in timings)


def demo(reference: SGLangServer, fleet: list[SGLangServer]) -> bool:
    prefill, decode = fleet[:2], fleet[2:]
    print("-- pd-router in front of " + ", ".join(f"{s.name} {s.url}" for s in fleet))
    with serving(*pd_args(prefill, decode), "--host", "127.0.0.1") as router:
        router_ready(router.url, prefill=2, decode=2)
        expected = {p: generate(reference.url, p)["output_ids"] for p in PROMPTS}
        ok = True
        for prompt in PROMPTS:
            reply = generate(router.url, prompt)
            same = reply["output_ids"] == expected[prompt]
            ok &= same
            print(f"   {'same as colocated' if same else 'DIFFERENT'}: {prompt!r} -> "
                  f"{reply['text']!r}")  # fmt: skip
        target = decode[1]
        with Traffic(router.url, expected) as traffic:
            for role in ("prefill", "decode"):
                print(f"-- converting {target.name} to {role} while {CLIENTS} clients send")
                record = convert(router.url, target, role)
                print(f"   {record['status']}: {phases(record)}")
                ok &= record["status"] == "succeeded"
            time.sleep(2.0)
        print(
            f"-- {traffic.sent} requests during the conversions: {traffic.failed} failed, "
            f"{traffic.different} with tokens different from the colocated server"
        )
        ok &= traffic.failed == 0 and traffic.different == 0
    return ok


def main() -> int:
    if reason := missing():
        print(f"demo-sglang: {reason}")
        return 1
    reference = server("colocated", None, extra=NO_RADIX)
    fleet = [
        server("p0", "prefill", extra=NO_RADIX),
        server("p1", "prefill", patched=True, extra=NO_RADIX),
        server("d0", "decode", extra=NO_RADIX),
        server("d1", "decode", patched=True, extra=NO_RADIX),
    ]
    started = time.monotonic()
    print("-- starting 5 real SGLang servers on the CPU (1.5-3 minutes on 2 cores)")
    with running([reference, *fleet]):
        print(f"   ready in {time.monotonic() - started:.0f} s")
        ok = demo(reference, fleet)
    print("demo-sglang: OK" if ok else "demo-sglang: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

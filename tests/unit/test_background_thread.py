"""The deferred encoder's thread yields the CPU: lowest niceness and, where Linux takes a custom
slice (EEVDF, >= 6.12), the smallest one (gateway/features/encode_executor.py,
``BACKGROUND_SLICE_NS``), read back from the kernel's own view of the thread."""

from __future__ import annotations

import asyncio
import platform
import threading
from pathlib import Path

import pytest

from gateway.features.encode_executor import (
    BACKGROUND_NICE,
    BACKGROUND_SLICE_NS,
    BACKGROUND_THREAD_NAME,
    EncodeExecutor,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")


def _release() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _seen_by_the_kernel() -> dict[str, str]:
    """This thread's name, niceness and slice as /proc shows them."""
    task = Path(f"/proc/self/task/{threading.get_native_id()}")
    out = {"comm": (task / "comm").read_text().strip()}
    out["nice"] = (task / "stat").read_text().rsplit(")", 1)[1].split()[16]
    sched = task / "sched"
    if sched.exists():
        for line in sched.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "se.slice":
                out["slice"] = value.strip()
    return out


def test_the_deferred_encoders_thread_is_named_niced_and_sliced() -> None:
    async def main() -> dict[str, str]:
        ex = EncodeExecutor(threads=1, offload_chars=1)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(ex.background_pool(), _seen_by_the_kernel)
        finally:
            await ex.close()

    seen = asyncio.run(main())
    assert seen["comm"] == BACKGROUND_THREAD_NAME.decode()
    assert int(seen["nice"]) == BACKGROUND_NICE
    if _release() >= (6, 12) and platform.machine() in ("x86_64", "aarch64"):
        if "slice" not in seen:
            pytest.skip("this kernel's /proc shows no se.slice")
        assert int(seen["slice"]) == BACKGROUND_SLICE_NS
        # only the background thread was changed: the calling thread keeps the default slice
        assert int(_seen_by_the_kernel().get("slice", 0)) != BACKGROUND_SLICE_NS

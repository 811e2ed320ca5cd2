"""The BLAS thread pools of this process (threadpoolctl, if installed), for the reports of
the benchmark's step scripts (each framework runs in its own process and environment)."""
from __future__ import annotations


def threads_info() -> list:
    try:
        from threadpoolctl import threadpool_info
        return [{k: i.get(k) for k in ("internal_api", "architecture", "num_threads",
                                       "version")} for i in threadpool_info()]
    except ImportError:
        return []

"""recd: RecD's deduplicated recommendation training, one library for every stage.

On import, before any module loads torch: OpenMP threads wait passively (recd_core/runtime.py:
spinning threads cost a shared machine 10x in step time)."""

from recd_core.runtime import quiet_openmp

quiet_openmp()

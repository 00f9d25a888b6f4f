"""Whole-sweep validation: every job's config composed and checked (launch/validate.py) before the first job
starts; and the size of the sweep's Ray cluster, which every job's placement group must fit."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from slime_hydra.sweep.jobs import shown_overrides

if TYPE_CHECKING:  # the validators import every component: loaded when a sweep starts, not when Hydra scans plugins
    from slime_hydra.config import RunConfig
    from slime_hydra.plan.resources import ResourcePlan


class SweepInvalid(ValueError):
    """Some jobs of the sweep are invalid; nothing was started."""


@dataclass
class Job:
    num: int
    overrides: List[str]
    problems: List[str] = field(default_factory=list)
    cfg: Optional["RunConfig"] = None
    plan: Optional["ResourcePlan"] = None
    dir: Optional[str] = None  # its run directory (hydra.sweep.dir / hydra.sweep.subdir)

    @property
    def cpus(self) -> float:
        return sum(b.get("CPU", 0) for b in self.plan.bundles) if self.plan else 0

    @property
    def gpus(self) -> float:
        return sum(b.get("GPU", 0) for b in self.plan.bundles) if self.plan else 0

    def label(self) -> str:
        return f"job {self.num} [{' '.join(self.overrides) or 'no overrides'}]"

    def plan_line(self) -> str:
        """The job's plan in one line (a sweep's dry run)."""
        p = self.plan
        mem = f", peak {p.memory.peak:.1f} GiB/GPU" if p.memory is not None else ""
        return (f"{self.label()}: {p.device}, {len(p.bundles)} bundles of {p.bundles[0]}, {len(p.trainers)} trainer(s) "
                f"(dp {p.data_parallel}), {len(p.engines)} {p.engine_kind} engine(s), "
                f"{'colocated' if p.colocate else 'split'}, {self.cfg.trainer.num_rollout} steps{mem}")


def compose(hydra_context, base: DictConfig, jobs: Sequence[Tuple[int, Sequence[str]]]) -> List[Job]:
    """Each job's config as its process will compose it, validated; problems are collected, not raised."""
    from slime_hydra.config import ConfigError
    from slime_hydra.launch.validate import check
    from slime_hydra.plan.resources import make_plan

    out = []
    for num, overrides in jobs:
        job = Job(num, shown_overrides(base, overrides))
        try:
            cfg = hydra_context.config_loader.load_sweep_config(base, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.num = num
                job.dir = os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir))
                del cfg["hydra"]
            job.cfg = check(cfg)
            job.plan = make_plan(job.cfg)
        except ConfigError as e:
            job.problems = list(e.violations)
        except Exception as e:  # noqa: BLE001 - a composition error (unknown key, bad value) of this job
            job.problems = [f"{type(e).__name__}: {e}".strip()]
        out.append(job)
    return out


def cluster_size(config: DictConfig, jobs: List[Job]) -> Tuple[int, Optional[int]]:
    """CPUs and GPUs of the sweep's local Ray cluster: ``sweep.num_cpus`` / ``num_gpus``, else room for
    ``sweep.max_concurrent`` of the largest job (logical CPUs) and the machine's GPUs (None)."""
    sweep = config.sweep
    need = max((j.cpus for j in jobs if j.plan), default=2)
    cpus = sweep.num_cpus or max(os.cpu_count() or 1, int(need) * int(sweep.max_concurrent))
    return cpus, sweep.num_gpus


def capacity_problems(jobs: List[Job], cpus: int, gpus: Optional[int]) -> None:
    """A job whose bundles exceed the whole cluster would wait forever: make it a problem now."""
    for j in jobs:
        for key, name, need, have in (("num_cpus", "CPUs", j.cpus, cpus), ("num_gpus", "GPUs", j.gpus, gpus)):
            if j.plan and have is not None and need > have:
                j.problems.append(f"sweep.{key}: the job's placement group needs {need:g} {name}, the sweep's Ray "
                                  f"cluster has {have}")


def validate_jobs(config: DictConfig, jobs: List[Job]) -> List[Job]:
    """The valid jobs; the invalid ones listed, and unless ``sweep.skip_invalid`` none starts (``SweepInvalid``)."""
    bad = [j for j in jobs if j.problems]
    if not bad:
        return jobs
    lines = [f"{len(bad)} of {len(jobs)} sweep jobs are invalid:"]
    for j in bad:
        lines.append(f"  {j.label()}")
        lines += [f"    - {p}" for p in j.problems]
    if not OmegaConf.select(config, "sweep.skip_invalid"):
        lines.append("nothing was started; fix them, or run the valid jobs only with sweep.skip_invalid=true")
        raise SweepInvalid("\n".join(lines))
    lines.append(f"sweep.skip_invalid=true: running the {len(jobs) - len(bad)} valid job(s)")
    print("\n".join(lines), flush=True)
    return [j for j in jobs if not j.problems]

"""slime_hydra: declarative RL post-training of LLMs.

    python run.py                                   # the embedded default: tiny model, CPU, minutes
    python run.py model=qwen3_4b algo=gspo dry_run=true
    python run.py -m algo.lr=1e-3,3e-3              # a sweep: one run directory each
    python run.py -m algo.lr=1e-3,3e-3 sweep.max_concurrent=2   # two at a time, on one Ray cluster
    python run.py -m hparams_search=grpo_digits     # an Optuna search with pruning
    python run.py experiment=qwen3_4b_grpo_math data.path=/data/math.jsonl
"""

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from slime_hydra.config.store import register_configs
from slime_hydra.launch.preempt import Preempted

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from slime_hydra.launch.main import run
    from slime_hydra.launch.stages import run_stages

    hc = HydraConfig.get()
    summary = (run_stages(cfg, hc.runtime.output_dir, list(hc.overrides.task)) if cfg.stages
               else run(cfg, hc.runtime.output_dir))
    return summary[cfg.sweep.optimized_metric] if summary else None  # a sweeper's objective


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        # Ctrl-C: the run has stopped by now (its actors killed, Ray shut down, what it started reaped:
        # launch/driver.py, launch/lease.py). Leave without the interpreter's teardown (torch's is slow):
        # a run must stop within seconds of Ctrl-C.
        sweep_dir = getattr(e, "slime_sweep_dir", None)  # a sweep's (slime_hydra/sweep/flow.py: INTERRUPTED_SWEEP)
        print(f"interrupted: the sweep stopped (go on with the same command and sweep.resume=true "
              f"hydra.sweep.dir={sweep_dir})" if sweep_dir else
              "interrupted: the run stopped (go on with trainer.resume=auto)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        logging.shutdown()  # the log files' last lines
        os._exit(130)
    except Preempted as e:  # SIGTERM or trainer.preempt_signal: saved (launch/preempt.py); a requeue goes on
        if not e.said:
            print(f"{e}: {e.note or 'the run stopped (go on with trainer.resume=auto)'}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(e.exit_code)

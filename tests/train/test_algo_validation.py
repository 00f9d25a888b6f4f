"""The algo presets compose and validate; each rule of `train/algorithms/rules.py` fires with its dotted key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from slime_hydra.config import load, resolve
from slime_hydra.config.store import register_configs
from slime_hydra.launch.validate import validate

CONF = str(Path(__file__).resolve().parents[2] / "conf")
PRESETS = sorted(p.stem for p in Path(CONF, "algo").glob("*.yaml"))
# run_name interpolates ${hydra:...}, which compose() does not set.
BASE = ["run_name=test"]


@pytest.fixture(scope="module")
def run():
    """overrides -> the resolved RunConfig."""
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        yield lambda *overrides: resolve(load(compose("config", overrides=[*BASE, *overrides])))


@pytest.fixture(scope="module")
def errors(run):
    return lambda *overrides: validate(run(*overrides))


def test_all_presets_exist():
    assert set(PRESETS) >= {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo", "reinforce_plus_plus",
                            "reinforce_plus_plus_baseline"}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_validates(errors, preset, tiny_ckpt):
    extra = [f"teacher.path={tiny_ckpt}"] if preset == "opd" else []  # distillation needs a teacher
    if preset == "reinforce_plus_plus":
        # conf/recipe/tiny_digits.yaml (the default model x data) sets algo.kl_loss_coef, and this preset's
        # KL is a reward (kl_coef): the two are exclusive.
        extra = ["algo.kl_loss_coef=0.0"]
    assert errors(f"algo={preset}", *extra) == []


def test_preset_values(run):
    def algo(name):
        # without the tiny task's overrides (conf/recipe/tiny_digits.yaml, conf/recipe_algo/tiny_digits_*.yaml)
        return run(f"algo={name}", "~recipe", "~recipe_algo").algo

    grpo = algo("grpo")
    assert (grpo.eps_clip, grpo.eps_clip_high, grpo.kl_loss_coef, grpo.loss_reduction) == (
        0.2, 0.28, 0.04, "sample_mean")
    dr = algo("dr_grpo")
    assert (dr.advantage_estimator, dr.normalize_std, dr.loss_reduction, dr.kl_loss_coef) == (
        "grpo", False, "token_sum", 0.0)
    dapo = algo("dapo")
    assert (dapo.eps_clip, dapo.eps_clip_high, dapo.loss_reduction, dapo.kl_loss_coef) == (0.2, 0.28, "token_mean", 0.0)
    gspo = algo("gspo")
    assert (gspo.policy_loss, gspo.eps_clip, gspo.eps_clip_high) == ("gspo", 3e-4, 4e-4)
    cispo = algo("cispo")
    assert (cispo.policy_loss, cispo.eps_clip, cispo.eps_clip_high) == ("cispo", 1.0, 4.0)
    ppo = algo("ppo")
    assert (ppo.advantage_estimator, ppo.gamma, ppo.lambd, ppo.critic_lr) == ("ppo", 1.0, 0.95, ppo.lr)
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert algo(name).normalize_advantages
    for name in PRESETS:
        a = algo(name)
        assert a.name == name and a.lr == (1e-5 if name == "sft" else 1e-6)  # SFT's usual rate is higher


def _has(errs, key, words):
    return any(e.startswith(key + ":") and words in e for e in errs)


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        # rules that predate the algorithms package
        (["algo.kl_coef=0.1", "algo.advantage_estimator=ppo"], "algo.kl_coef", "both set"),
        (["algo=reinforce_plus_plus", "algo.kl_loss_coef=0", "algo.normalize_advantages=false"],
         "algo.normalize_advantages", "needs"),
        (["algo.use_tis=true", "algo.use_rollout_logprobs=true"], "algo.use_tis", "use_rollout_logprobs"),
        (["algo.eps_clip_c=0.5"], "algo.eps_clip_c", "> 1"),
        # rules added with the algorithms package
        (["algo.kl_loss_coef=-0.1"], "algo.kl_coef", ">= 0"),
        (["algo=gspo", "algo.policy_loss=ppo_clip"], "algo.policy_loss", "policy_loss=gspo"),
        (["algo=cispo", "algo.policy_loss=ppo_clip"], "algo.policy_loss", "policy_loss=cispo"),
        (["algo=cispo", "algo.eps_clip_c=3.0"], "algo.eps_clip_c", "cispo"),
        (["algo=dapo", "algo.kl_loss_coef=0", "algo.use_unbiased_kl=true"], "algo.use_unbiased_kl", "kl_loss_coef"),
        (["algo.use_tis=true", "algo.tis_clip=0"], "algo.tis_clip", "tis_clip > 0"),
        (["algo.kl_loss_type=k1", "algo.kl_loss_coef=0.01"], "algo.kl_loss_type", "trains nothing"),
        (["algo=dapo", "algo.overlong_buffer_len=1"], "algo.overlong_buffer_len", "< rollout.max_response_len=1"),
        (["algo=dapo", "algo.overlong_penalty_factor=-1"], "algo.overlong_buffer_len", ">= 0"),
        (["algo=ppo", "algo.value_clip=0"], "algo.value_clip", "> 0"),
        (["algo=ppo", "algo.critic_lr=-1e-6"], "algo.critic_lr", "> 0"),
        (["algo=ppo", "algo.num_critic_only_steps=-1"], "algo.num_critic_only_steps", ">= 0"),
        (["algo=grpo", "algo.num_critic_only_steps=2"], "algo.num_critic_only_steps", "only advantage_estimator=ppo"),
        (["algo=grpo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt", "every advantage is 0"),
        (["algo=reinforce_plus_plus_baseline", "rollout.n_samples_per_prompt=1"],
         "rollout.n_samples_per_prompt", "every advantage is 0"),
    ],
)
def test_rule_fires(errors, overrides, key, words):
    errs = errors(*overrides)
    assert _has(errs, key, words), errs


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=grpo", "algo.policy_loss=gspo"],  # GSPO loss on GRPO advantages: allowed
        ["algo=grpo", "rollout.n_samples_per_prompt=1", "algo.normalize_rewards=false"],
        ["algo=ppo", "rollout.n_samples_per_prompt=1"],
        ["algo=ppo", "algo.kl_loss_coef=0", "algo.kl_coef=0.01"],  # k1 (ppo's) as the KL reward
        ["algo.kl_loss_type=k1", "algo.kl_loss_coef=0.01", "algo.use_unbiased_kl=true"],
        ["algo=dapo", "rollout.max_response_len=8", "algo.overlong_buffer_len=4"],
    ],
)
def test_allowed_combinations(errors, overrides):
    assert not [e for e in errors(*overrides) if e.startswith(("algo.", "rollout.n_samples"))]


def test_tiny_task_algorithm_recipes(run):
    """conf/recipe_algo/tiny_digits_<preset>.yaml: applied on the embedded default after the tiny recipe,
    only for its own preset and only on model=tiny data=digits; each names an existing preset."""
    files = sorted(Path(CONF, "recipe_algo").glob("*.yaml"))
    assert files
    for f in files:
        assert f.stem.startswith("tiny_digits_") and f.stem.removeprefix("tiny_digits_") in PRESETS, f.name
    for preset in ("dr_grpo", "dapo", "gspo", "cispo", "ppo", "reinforce_plus_plus_baseline"):
        cfg = run(f"algo={preset}")
        assert (cfg.algo.kl_loss_coef, cfg.algo.kl_loss_type, cfg.algo.lr) == (0.04, "low_var_kl", 3e-3), preset
        assert run(f"algo={preset}", "model=qwen3_4b").algo.kl_loss_coef == 0.0  # not on another model
        assert run(f"algo={preset}", "algo.kl_loss_coef=0.0").algo.kl_loss_coef == 0.0  # the command line wins
    assert run("algo=dapo").rollout.max_sampled_groups == 128
    assert run("algo=grpo").rollout.max_sampled_groups is None
    assert run("algo=reinforce_plus_plus").algo.kl_loss_coef == 0.0  # its KL is the reward's (kl_coef)

"""load_hook: dotted paths, _target_ nodes (dict and DictConfig), callables; call_maybe_async."""

import asyncio
import functools
import textwrap

import pytest
from omegaconf import OmegaConf

from slime_hydra.utils.hooks import HookError, call_maybe_async, load_hook


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
    (tmp_path / "my_hooks").mkdir()
    (tmp_path / "my_hooks" / "__init__.py").write_text("")
    (tmp_path / "my_hooks" / "fns.py").write_text(textwrap.dedent("""
        def scale(x, factor=2):
            return x * factor

        async def ascale(x, factor=2):
            return x * factor

        class Box:
            @staticmethod
            def inner(x):
                return x + 1

        NOT_CALLABLE = 3
    """))
    (tmp_path / "my_hooks" / "broken.py").write_text("import does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_hooks.fns"


def test_dotted_path(user_mod):
    assert load_hook(f"{user_mod}.scale")(3) == 6
    assert load_hook(f"{user_mod}.Box.inner")(1) == 2  # attribute chains


def test_target_dict_binds_extra_keys_as_kwargs(user_mod):
    fn = load_hook({"_target_": f"{user_mod}.scale", "factor": 5})
    assert isinstance(fn, functools.partial) and fn(2) == 10
    fn = load_hook(OmegaConf.create({"_target_": f"{user_mod}.scale", "factor": 7}))
    assert fn(1) == 7
    fn = load_hook(OmegaConf.create({"_target_": f"{user_mod}.scale", "factor": [1, 2]}))
    assert fn(1) == [1, 2] and type(fn.keywords["factor"]) is list  # plain containers, not ListConfig


def test_callable_passes_through():
    f = lambda x: x  # noqa: E731
    assert load_hook(f) is f


@pytest.mark.parametrize("spec, needle", [
    ("nopkg_xyz.mod.fn", "no module 'nopkg_xyz.mod'"),
    ("my_hooks.fns.missing", "'my_hooks.fns' has no attribute 'missing'"),
    ("my_hooks.nomod.fn", "no module 'my_hooks.nomod'"),
    ("my_hooks.fns.NOT_CALLABLE", "not callable"),
    ("my_hooks.broken.fn", "does_not_exist_xyz"),  # a missing import inside the user's module
    ("justaname", "dotted path"),
    ({"factor": 1}, "_target_"),
    ({"_target_": "my_hooks.fns.nope"}, "my_hooks.fns.nope"),
    (42, "expected a dotted path"),
])
def test_errors_name_the_spec(user_mod, spec, needle):
    with pytest.raises(HookError) as e:
        load_hook(spec)
    assert needle in str(e.value)


def test_call_maybe_async(user_mod):
    sync_fn, async_fn = load_hook(f"{user_mod}.scale"), load_hook({"_target_": f"{user_mod}.ascale", "factor": 3})
    assert asyncio.run(call_maybe_async(sync_fn, 4)) == 8
    assert asyncio.run(call_maybe_async(async_fn, 4)) == 12

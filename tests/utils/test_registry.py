"""The one name -> function registry behind advantages, losses, KL estimators and rewards."""

from __future__ import annotations

import pytest

from meshrl.utils.registry import Registry


def _one() -> int:
    return 1


def _two() -> int:
    return 2


def test_register_returns_the_function_and_get_finds_it():
    reg: Registry = Registry("widget")

    assert reg.register("one")(_one) is _one

    assert reg.get("one") is _one
    assert "one" in reg and "two" not in reg
    assert reg.names() == ["one"]


def test_registering_the_same_function_again_is_a_no_op():
    reg: Registry = Registry("widget")
    reg.register("one")(_one)

    reg.register("one")(_one)

    assert reg.get("one") is _one


def test_a_different_function_under_a_taken_name_is_refused_and_the_first_stays():
    reg: Registry = Registry("widget")
    reg.register("one")(_one)

    with pytest.raises(ValueError, match=r"widget 'one' is already registered \(to .*_one\)"):
        reg.register("one")(_two)

    assert reg.get("one") is _one


def test_unknown_name_is_one_line_naming_the_value_and_every_registered_name():
    reg: Registry = Registry("widget")
    reg.register("one")(_one)
    reg.register("two")(_two)

    with pytest.raises(KeyError) as info:
        reg.get("three", hint=" (or a module:function)")

    message = info.value.args[0]
    assert message == ("unknown widget 'three'; registered: ['one', 'two'] "
                       "(or a module:function)")
    assert "\n" not in message

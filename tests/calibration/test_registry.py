"""calibration.registry.Registry: the one shape of every table of named choices."""

import argparse
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calibration.registry import DuplicateName, Registry, UnknownName


@dataclass(frozen=True)
class Info:
    name: str
    value: int = 0
    options: type | None = None


def test_register_get_and_refuse_a_taken_name_unless_replacing():
    reg: Registry[Info] = Registry("widget")
    a = reg.register(Info("a", 1))
    assert reg.get("a") is a and reg["a"] is a and "a" in reg and len(reg) == 1
    assert reg.register(Info("a", 1)) == a  # the same entry again (a module imported twice)
    with pytest.raises(DuplicateName, match="widget 'a' is already registered.*replace=True"):
        reg.register(Info("a", 2))
    assert reg.get("a").value == 1
    reg.register(Info("a", 2), replace=True)
    assert reg.get("a").value == 2


def test_an_unknown_name_lists_the_choices_and_is_a_key_and_a_value_error():
    reg: Registry[Info] = Registry("widget")
    reg.register(Info("a"))
    reg.register(Info("b"))
    with pytest.raises(UnknownName) as e:
        reg.get("c")
    assert str(e.value) == "unknown widget 'c'; registered: ['a', 'b']"
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    assert reg.get("c", None) is None


@pytest.mark.parametrize("name", ["", "  ", None, 3])
def test_a_name_must_be_a_non_empty_string(name):
    with pytest.raises(ValueError, match="non-empty string name"):
        Registry("widget").register(Info(name))


def test_the_check_runs_before_the_entry_is_added():
    def positive(info):
        if info.value <= 0:
            raise ValueError(f"value must be positive, got {info.value}")

    reg: Registry[Info] = Registry("widget", check=positive)
    with pytest.raises(ValueError, match="positive"):
        reg.register(Info("a", 0))
    assert "a" not in reg


def test_names_are_live_argparse_choices_and_filterable():
    reg: Registry[Info] = Registry("widget")
    reg.register(Info("a", 1))
    names, odd = reg.names(), reg.names(lambda i: i.value % 2 == 1)
    p = argparse.ArgumentParser()
    p.add_argument("--w", choices=names)
    reg.register(Info("b", 2))  # registered after the parser was built: still a choice
    assert p.parse_args(["--w", "b"]).w == "b"
    with pytest.raises(SystemExit):
        p.parse_args(["--w", "z"])
    assert list(names) == ["a", "b"] and list(odd) == ["a"] and names == ("a", "b")


def test_registered_scopes_an_entry_and_restores_what_it_replaced():
    reg: Registry[Info] = Registry("widget")
    reg.register(Info("a", 1))
    with reg.registered(Info("b")):
        assert "b" in reg
    assert "b" not in reg
    with reg.registered(Info("a", 5), replace=True):
        assert reg["a"].value == 5
    assert reg["a"].value == 1


def test_options_of_reads_the_declared_dataclass():
    @dataclass
    class Opts:
        k: int = 1

    reg: Registry[Info] = Registry("widget")
    reg.register(Info("a", options=Opts))
    reg.register(Info("b"))
    assert reg.options_of("a") is Opts and reg.options_of("b") is None


@given(st.lists(st.text(min_size=1).filter(str.strip), unique=True, max_size=8))
def test_order_is_registration_order(names):
    reg: Registry[Info] = Registry("widget")
    for n in names:
        reg.register(Info(n))
    assert list(reg) == names == list(reg.names())

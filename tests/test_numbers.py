"""The shared comparison of recomputed numbers (tests/numbers.py): round-off passes, anything
a reader could see fails, and the failure names where."""

import math

import pytest

from tests.numbers import assert_same_numbers, differences

PUBLISHED = {"rows": [{"name": "sft", "ece": 0.1234567890123, "n": 800, "ok": True,
                       "auroc": math.nan, "ci": [0.1, 0.2], "note": None}]}


def copy_with(**changes):
    row = {**PUBLISHED["rows"][0], **changes}
    return {"rows": [row]}


def test_round_off_of_another_summation_order_passes():
    assert_same_numbers(copy_with(ece=0.1234567890123 * (1 + 2.1e-15)), PUBLISHED)
    assert differences(PUBLISHED, PUBLISHED) == []


@pytest.mark.parametrize("changes, where", [
    ({"ece": 0.1234567890123 * (1 + 1e-9)}, "$.rows[0].ece"),
    ({"name": "calm"}, "$.rows[0].name"),
    ({"n": 800.0}, "$.rows[0].n"),          # a count that became a float is a change
    ({"ok": 1}, "$.rows[0].ok"),
    ({"auroc": 0.5}, "$.rows[0].auroc"),    # NaN only equals NaN
    ({"ci": [0.1]}, "$.rows[0].ci"),
    ({"note": "x"}, "$.rows[0].note"),
])
def test_a_visible_difference_fails_and_names_its_path(changes, where):
    found = differences(copy_with(**changes), PUBLISHED)
    assert len(found) == 1 and found[0].startswith(where)
    with pytest.raises(AssertionError, match=where.replace("$", r"\$").replace("[", r"\[")):
        assert_same_numbers(copy_with(**changes), PUBLISHED)


def test_a_missing_or_extra_key_fails():
    row = dict(PUBLISHED["rows"][0])
    del row["note"]
    assert differences({"rows": [row]}, PUBLISHED) == [
        "$.rows[0]: keys ['name', 'ece', 'n', 'ok', 'auroc', 'ci'] != "
        "['name', 'ece', 'n', 'ok', 'auroc', 'ci', 'note']"]

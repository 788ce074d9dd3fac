"""docs/deviations.md names real switches: every key, config group option and value in its "switch to upstream"
column exists in the config schema it belongs to (the run's, an estimator's / scheme's / loss term's, RELEX's)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "deviations.md"
CONF = ROOT / "conf"


def switch_cells() -> list[tuple[str, str, str]]:
    """(section, row label, switch cell) of every table whose last column is 'switch to upstream'."""
    out, section, in_table = [], "", False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section, in_table = line[3:].strip(), False
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[-1] == "switch to upstream":
                in_table = True
            elif in_table and not set(cells[0]) <= {"-", " "}:
                out.append((section, cells[0], cells[-1]))
        else:
            in_table = False
    return out


def switches(cell: str) -> list[tuple[str, str]]:
    """(key or group, value) of each `key=value`, `key: value` or `group=option` in a cell's code spans."""
    out = []
    for span in re.findall(r"`([^`]+)`", cell):
        for tok in span.replace(": ", ":").split():
            m = re.fullmatch(r"\+?([A-Za-z_][\w.]*)[=:](.*)", tok)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def _schema_has(key: str, section: str) -> bool:
    from grail_exp.advantages import SCHEMES
    from grail_exp.config import RunConfig
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.extrapolate import ExtrapolateConfig
    from grail_exp.loss import LOSS_TERMS

    def has(cls, dotted: str) -> bool:  # a path of fields through the schema's dataclasses
        for part in dotted.split("."):
            if not dataclasses.is_dataclass(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
                return False
            hint = typing.get_type_hints(cls)[part]
            inner = [a for a in typing.get_args(hint) if a is not type(None)]
            cls = inner[0] if typing.get_origin(hint) is typing.Union and inner else hint
        return True

    head, _, rest = key.partition(".")
    if section == "RELEX":
        return has(ExtrapolateConfig, key)
    if head == "advantage":
        return any(has(cls.config_class, rest) for cls in SCHEMES.values())
    if head == "estimator":
        return any(has(spec.config_class, rest) for spec in ESTIMATORS.values())
    if key.startswith("loss.terms."):
        term, _, field = key[len("loss.terms."):].partition(".")
        return term in LOSS_TERMS and has(LOSS_TERMS[term].config_class, field)
    return has(RunConfig, key)


CELLS = switch_cells()


def test_the_table_parser_sees_the_switches():
    assert len(CELLS) >= 40
    found = {k for _, _, cell in CELLS for k, _ in switches(cell)}
    assert {"loss.family_mask_normaliser", "optim.schedule_unit", "rollout", "loss.loss_type",
            "estimator"} <= found, found


@pytest.mark.parametrize("section, row, cell", CELLS, ids=[f"{s}: {r[:50]}" for s, r, _ in CELLS])
def test_every_switch_named_in_deviations_exists(section, row, cell):
    for key, value in switches(cell):
        group = CONF / key
        if "." not in key and group.is_dir():  # a config group: its option must be a file of the group
            pattern = re.sub(r"<\w+>", "*", value)  # experiment=paper/<model>_<scheme>
            assert list(group.glob(pattern + ".yaml")), f"{row}: no conf/{key}/{value}.yaml"
            continue
        assert _schema_has(key, section), f"{row}: {key} is not a key of the config schema"

"""The rule table's contract, over every family's test file: each registered rule has its case (it fires on its
model and meets the five perturbations, or says why one does not apply) in its own family's file, and each rule
newer than the exporter fixtures an exporter case. ``python -m tests.passes.fuse.test_contract`` prints the
coverage matrix."""

from __future__ import annotations

import sys
from collections import Counter
from types import ModuleType

from graphopt.passes.fuse import registered_rules
from tests.passes.fuse import (
    test_activation,
    test_arith,
    test_attention,
    test_conv,
    test_embed,
    test_expose,
    test_gather,
    test_islands,
    test_kronecker,
    test_lower,
    test_matmul,
    test_norm,
    test_precision,
    test_qdq,
    test_rotary,
    test_shape,
    test_through_qdq,
)
from tests.passes.fuse.table import (
    FLOAT32_ONLY,
    KINDS,
    PRECISIONS,
    At,
    Case,
    Exported,
    NamesType,
    Perturb,
    exported_perturbation,
    interior_quantized,
    perturbation,
)

# The family each test file holds (the shape family's file also holds the two noop rules shape.py shares).
FAMILIES: dict[str, ModuleType] = {
    "activation": test_activation,
    "arith": test_arith,
    "attention": test_attention,
    "conv": test_conv,
    "embed": test_embed,
    "expose": test_expose,
    "gather": test_gather,
    "islands": test_islands,
    "kronecker": test_kronecker,
    "lower": test_lower,
    "matmul": test_matmul,
    "noop": test_shape,
    "norm": test_norm,
    "qdq": test_qdq,
    "rotary": test_rotary,
    "shape": test_shape,
}
MODULES = list(dict.fromkeys(FAMILIES.values()))
CASES: dict[str, Case] = {name: case for module in MODULES for name, case in module.CASES.items()}
EXPORTED: dict[str, Exported | str] = {n: s for module in MODULES for n, s in module.EXPORTED.items()}
BEFORE_EXPORTS = frozenset(name for module in MODULES for name in module.BEFORE_EXPORTS)


def test_every_registered_rule_has_a_case() -> None:
    """A new rule needs a CASE: its model and its perturbations (or why one does not apply)."""
    assert sorted(r.name for r in registered_rules()) == sorted(CASES)


def test_every_case_is_in_its_familys_file() -> None:
    """A rule's case, exporter case and BEFORE_EXPORTS entry sit in its family's test file, and only there."""
    for rule in registered_rules():
        holders = [m.__name__ for m in MODULES if rule.name in {*m.CASES, *m.EXPORTED, *m.BEFORE_EXPORTS}]
        assert holders == [FAMILIES[rule.family].__name__], (rule.name, holders)


def test_every_newer_rule_has_an_exporter_case() -> None:
    """A rule newer than the exporter fixtures needs an EXPORTED entry too: its case on an exporter-written graph,
    or why there is none."""
    names = {r.name for r in registered_rules()}
    assert sorted(names - BEFORE_EXPORTS) == sorted(EXPORTED)
    assert not BEFORE_EXPORTS - names, "a rule gone: drop it from its family's BEFORE_EXPORTS"


def test_every_rule_a_precision_names_has_a_case() -> None:
    """test_precision's declarations name registered rules (a renamed rule keeps its precision cases)."""
    named = {*(name for declared in test_precision.DECLARED.values() for name in declared)}
    named |= {name for _, name, _ in test_precision.REASONS}
    assert named <= set(CASES), named - set(CASES)


def _cell(found: At | Perturb | str) -> str:
    if isinstance(found, str):
        return found
    cell = "near miss" if found.reason else "no match"
    cell += ", the conversion stops" if isinstance(found, Perturb) and found.stops else ""
    return f"{cell} ({found.note})" if found.note else cell


def precision_cell(name: str, precision: str) -> str:
    """What the table runs of rule ``name`` at ``precision``: that it fires, and the perturbations that refuse it
    there (test_precision.py; through Q/DQ also test_through_qdq.py), or why not; "-" where no variant fires it."""
    case = CASES[name]
    if precision != "qdq":
        why, extra = test_precision.DECLARED[precision].get(name, "-"), []
    else:
        why = test_precision.QDQ.get(name, test_through_qdq.NOT_THROUGH_QDQ.get(name, "-"))
        interior = interior_quantized(case) if name in test_precision.THROUGH_QDQ else None
        if interior == FLOAT32_ONLY:
            return FLOAT32_ONLY
        if interior is not None and why == "-":  # fires through Q/DQ, though no variant asked for it
            why = ""
        extra = ["quantized reader"] if isinstance(interior, tuple) else []
    if isinstance(why, NamesType):
        return f"refused, the type named ({why.reason})"
    own = False
    if isinstance(why, Case):  # a case of its own at this precision (the variants' spelling)
        case, why, own = why, None, True
    if why not in (None, ""):
        return str(why)
    kinds = extra + [kind for kind in KINDS if why is None and isinstance(perturbation(case, kind), Perturb)]
    return "fires" + (" on a case of its own" if own else "") + (f"; refused: {', '.join(kinds)}" if kinds else "")


def coverage_matrix() -> str:
    """The rule x test-kind matrix as a Markdown table: each rule's case built here (with the precisions it runs at),
    then its case on an exporter-written graph (the graph column names the fixture) or why it has none; then how
    many rules fire at each precision, and how many perturbations refuse them there."""
    columns = ["fires, outputs kept", *KINDS, *PRECISIONS]
    lines = ["| rule | graph | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, case in CASES.items():
        cells = [_cell(perturbation(case, kind)) for kind in KINDS] + [precision_cell(name, p) for p in PRECISIONS]
        lines.append(f"| {name} | built here | yes | " + " | ".join(cells) + " |")
        spec = EXPORTED.get(name)
        if isinstance(spec, Exported):
            cells = [_cell(exported_perturbation(spec, kind)) for kind in KINDS]
            lines.extend(f"| {name} | export {f} | yes | " + " | ".join(cells) + " |" for f in spec.fixtures)
        elif spec is not None:
            lines.append(f"| {name} | export: {spec} |" + " |" * (len(columns) - 1))
    lines.append("")
    for precision in PRECISIONS:
        cells = [precision_cell(name, precision) for name in CASES]
        fired = [c for c in cells if c.startswith("fires")]
        refused = Counter(kind for c in fired if "; refused: " in c for kind in c.split("; refused: ")[1].split(", "))
        kinds = ", ".join(f"{kind} {count}" for kind, count in refused.items())
        named = sum(c.startswith("refused, the type named") for c in cells)
        lines.append(
            f"{precision}: {len(fired)} rules fire; refused by: {kinds}; {named} rules refused there, naming the type"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(coverage_matrix() + "\n")

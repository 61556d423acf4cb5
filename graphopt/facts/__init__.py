"""Facts about values that rewrites need: types with symbolic dims and symbolic int values.

:class:`Facts` answers on demand and memoizes; :func:`infer_model` types a whole model
(the ``shape-infer`` pass). The rule tables live in :mod:`rules` (types) and :mod:`values`
(symbolic values); :mod:`op` is what a rule sees of one node.
"""

from graphopt.facts.infer import InferenceSummary, fully_known, infer_model
from graphopt.facts.op import Op, SymValue
from graphopt.facts.service import Facts, OnnxTypes

__all__ = ["Facts", "InferenceSummary", "OnnxTypes", "Op", "SymValue", "fully_known", "infer_model"]

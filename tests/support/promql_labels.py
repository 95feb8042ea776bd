"""Which metrics and labels a PromQL expression reads, checked against what processes export.

A small recursive-descent parser for the PromQL a dashboard uses (selectors with matchers and
ranges, function calls, aggregations with ``by``/``without`` before or after their argument,
binary operators with ``on``/``ignoring`` and ``group_left``/``group_right``, numbers,
strings, ``offset``), and one check over its tree: every metric a selector names is exported;
every label a matcher, a grouping, a vector match or ``label_replace``'s source names is one
that the series reaching that point carry. So a panel that groups by a label its metric does
not have (an empty panel in Grafana, never an error) fails here.

``exported`` maps each series name to the label names its samples carry, as scraped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<num>(?:\d+\.?\d*(?:e[+-]?\d+)?|\.\d+)(?:ms|s|m|h|d|w|y)?)
    | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){}\[\],])
    )""",
    re.VERBOSE | re.IGNORECASE,
)
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "group",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
PRECEDENCE = [{"or"}, {"and", "unless"}, {"==", "!=", ">", "<", ">=", "<="}, {"+", "-"}]
PRECEDENCE += [{"*", "/", "%"}, {"^"}]


@dataclass
class Node:
    kind: str  # selector, call, aggregation, binary, number, string
    name: str = ""
    args: list[Node] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # matchers, grouping or matching labels
    without: bool = False


class PromQLError(ValueError):
    pass


def tokens(expr: str) -> list[str]:
    out, at = [], 0
    expr = expr.rstrip()
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if not match or match.end() == at:
            raise PromQLError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        out.append(match.group(match.lastgroup or "").strip())
        at = match.end()
    return out


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = tokens(expr)
        self.at = 0

    def peek(self) -> str:
        return self.toks[self.at] if self.at < len(self.toks) else ""

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if want is not None and tok.lower() != want:
            raise PromQLError(f"expected {want!r}, found {tok!r} in {self.expr!r}")
        self.at += 1
        return tok

    def parse(self) -> Node:
        node = self.binary(0)
        if self.peek():
            raise PromQLError(f"unexpected {self.peek()!r} in {self.expr!r}")
        return node

    def binary(self, level: int) -> Node:
        if level == len(PRECEDENCE):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek().lower() in PRECEDENCE[level]:
            op = self.take().lower()
            if self.peek().lower() == "bool":
                self.take()
            matching: list[str] = []
            if self.peek().lower() in ("on", "ignoring"):
                ignoring = self.take().lower() == "ignoring"
                matching = self.label_list()
                if ignoring:
                    matching = []  # labels ignored need not exist
            if self.peek().lower() in ("group_left", "group_right"):
                self.take()
                if self.peek() == "(":
                    self.label_list()
            right = self.binary(level + 1)
            left = Node("binary", op, [left, right], matching)
        return left

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            self.take()
        node = self.primary()
        while self.peek() == "[":  # a range or a subquery
            while self.take() != "]":
                pass
        if self.peek().lower() == "offset":
            self.take()
            self.take()
        return node

    def label_list(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return names

    def primary(self) -> Node:
        tok = self.peek()
        if tok == "(":
            self.take()
            node = self.binary(0)
            self.take(")")
            return node
        if tok[:1] in "\"'":
            self.take()
            return Node("string", tok[1:-1])
        if re.fullmatch(r"[\d.].*", tok) or tok.lower() in ("inf", "nan"):
            self.take()
            return Node("number", tok)
        if tok == "{":
            raise PromQLError(f"a selector without a metric name in {self.expr!r}")
        name = self.take()
        if name.lower() in AGGREGATIONS:
            return self.aggregation(name.lower())
        if self.peek() == "(":
            self.take()
            args = []
            while self.peek() != ")":
                args.append(self.binary(0))
                if self.peek() == ",":
                    self.take()
            self.take(")")
            return Node("call", name, args)
        labels = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                labels.append(self.take())
                self.take()  # the operator
                self.take()  # the value
                if self.peek() == ",":
                    self.take()
            self.take("}")
        return Node("selector", name, labels=labels)

    def aggregation(self, name: str) -> Node:
        grouping: list[str] = []
        without = False
        if self.peek().lower() in ("by", "without"):
            without = self.take().lower() == "without"
            grouping = self.label_list()
        self.take("(")
        args = [self.binary(0)]
        while self.peek() == ",":
            self.take()
            args.append(self.binary(0))
        self.take(")")
        if self.peek().lower() in ("by", "without"):
            without = self.take().lower() == "without"
            grouping = self.label_list()
        return Node("aggregation", name, args, grouping, without)


def parse(expr: str) -> Node:
    return _Parser(expr).parse()


def metric_names(expr: str) -> set[str]:
    """The metric names the expression's selectors name."""
    found: set[str] = set()

    def walk(node: Node) -> None:
        if node.kind == "selector":
            found.add(node.name)
        # Grafana's label_values(metric, label): its second argument is a label.
        for arg in node.args[:1] if node.name == "label_values" else node.args:
            walk(arg)

    walk(parse(expr))
    return found


def problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What the expression reads that ``exported`` lacks (empty: every name and label is there)."""
    found: list[str] = []

    def labels(node: Node) -> set[str]:
        """The label names of the series ``node`` yields (``__name__`` aside)."""
        if node.kind == "selector":
            if node.name not in exported:
                found.append(f"no metric {node.name}")
                return set()
            have = exported[node.name]
            found.extend(
                f"{node.name} has no label {label!r}"
                for label in node.labels
                if label not in have and label != "__name__"
            )
            return set(have)
        if node.kind in ("number", "string"):
            return set()
        if node.name == "label_values":  # Grafana's template function: (metric, label)
            vector = labels(node.args[0])
            if len(node.args) > 1 and node.args[-1].name not in vector:
                found.append(f"label_values: {node.args[-1].name!r} is not a label of its metric")
            return vector
        inner = [labels(arg) for arg in node.args]
        vectors = [s for s, arg in zip(inner, node.args, strict=True) if arg.kind != "string"]
        if node.kind == "aggregation":
            (vector,) = vectors[-1:]  # topk(10, v), quantile(0.9, v): the vector is last
            missing = [label for label in node.labels if label not in vector]
            found.extend(
                f"{node.name} by {label!r}: not a label of its argument" for label in missing
            )
            if node.without:
                return vector - set(node.labels)
            if node.name in ("topk", "bottomk"):  # they pick series, keeping their labels
                return vector
            return set(node.labels)
        if node.kind == "binary":
            left, right = inner
            for label in node.labels:
                for side, have in (("left", left), ("right", right)):
                    if node.args[0 if side == "left" else 1].kind != "number" and label not in have:
                        found.append(f"on ({label}): not a label of the {side} side")
            return left or right
        if node.name == "label_replace":  # (v, dst, replacement, src, regex)
            vector = inner[0]
            source = node.args[3].name
            if source and source not in vector:
                found.append(f"label_replace reads {source!r}: not a label of its argument")
            return vector | {node.args[1].name}
        if node.name == "histogram_quantile":
            vector = inner[-1]
            if "le" not in vector:
                found.append("histogram_quantile of series without 'le'")
            return vector - {"le"}
        return vectors[0] if vectors else set()

    labels(parse(expr))
    return found


def exported(text: str) -> dict[str, set[str]]:
    """A /metrics scrape's series names, each with the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: its panels' (rows' included) and its
    query variables'."""
    dashboard = json.loads(path.read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    out = [t["expr"] for p in panels for t in p.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        out.append(query["query"] if isinstance(query, dict) else str(query))
    return out

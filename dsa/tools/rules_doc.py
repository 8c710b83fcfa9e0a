"""Generates the rule reference (docs/rules.md) from the rules' own `doc` strings and attribute docs.

    bin/dsa rules-doc > docs/rules.md          # or: python -m dsa.tools.rules_doc > docs/rules.md

The page documents the public API, rules/defs.bzl, and then rules/testing.bzl (the stand-in generators and the
test macro, kept apart from the real rules). No stardoc: those files and the .bzl files they load are parsed with Python's `ast` (the Starlark the rule set
uses is valid Python syntax) and their module-level assignments evaluated by a small evaluator that knows
`rule`, `provider`, `attr.*`, `Label`, `dict`, `struct`, list/dict/string literals, `+` and `%`, and follows
`load()` to other files of this repository. Anything else it meets on the way to a documented value is an
error naming the file and line, never a silently dropped attribute. Assignments are evaluated on demand, so a
construct the evaluator does not know only matters when the reference needs its value; a statement that could
change a value behind its back (a top-level call, `+=`, an `if`) is refused wherever it is.

The reference is never edited by hand: //tests/rules_doc:rules_doc_test fails when the checked-in page differs
from what this prints.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsa.core.errors import DsaError, run_cli

# The public API: the file whose exported names the reference documents, relative to the repository root.
DEFS = "rules/defs.bzl"
# The stand-in generators and dsa_py_test: documented after the public API, in a section of their own.
TESTING = "rules/testing.bzl"
COMMAND = "`bin/dsa rules-doc` (`python -m dsa.tools.rules_doc`)"
REGENERATE = "python -m dsa.tools.rules_doc > docs/rules.md"

# attr.* kinds and the default Bazel gives an attribute of that kind when the rule sets none.
ATTR_KINDS = {
    "bool": False,
    "int": 0,
    "int_list": [],
    "label": None,
    "label_keyed_string_dict": {},
    "label_list": [],
    "output": None,
    "output_list": [],
    "string": "",
    "string_dict": {},
    "string_keyed_label_dict": {},
    "string_list": [],
    "string_list_dict": {},
}


class RulesDocError(DsaError):
    """A .bzl construct the generator cannot evaluate, or a public name it cannot document."""


def default_root() -> Path:
    """The directory that holds rules/ and dsa/: the dsa package's parent, as imported (not through symlinks,
    so that in a test's runfiles tree it is the runfiles' workspace directory, where the .bzl files are)."""
    return Path(__file__).parent.parent.parent


# ---- values the evaluator produces -------------------------------------------------------------------


@dataclass(frozen=True)
class LabelValue:
    label: str


@dataclass(frozen=True)
class External:
    """A name loaded from another repository (`@rules_python//python:defs.bzl` `PyInfo`): known by name only."""

    name: str
    source: str


@dataclass
class Function:
    name: str
    node: ast.FunctionDef
    module: "Module"

    @property
    def doc(self) -> str:
        return inspect.cleandoc(ast.get_docstring(self.node, clean=False) or "")


@dataclass
class Attr:
    kind: str
    kwargs: Dict[str, Any]
    where: str


@dataclass
class Provider:
    kwargs: Dict[str, Any]
    where: str
    name: Optional[str] = None


@dataclass
class Rule:
    kwargs: Dict[str, Any]
    where: str
    name: Optional[str] = None


@dataclass(frozen=True)
class Struct:
    fields: Tuple[Tuple[str, Any], ...]


# ---- modules, loads and the evaluator ----------------------------------------------------------------

_PENDING = object()


@dataclass
class _Binding:
    node: Optional[ast.AST]  # the assigned expression (None for a def or a load)
    module: "Module"
    line: int
    value: Any = _PENDING
    loaded_from: Optional[Tuple["Module", str]] = None  # (module, name) for a name load()ed from this repository
    loaded: bool = False  # bound by load(): file-local, never exported (as in Bazel)
    evaluating: bool = False


@dataclass
class Module:
    path: Path  # as given (never resolved)
    name: str  # relative to the root: what error messages say
    loader: "_Loader"
    bindings: Dict[str, _Binding] = field(default_factory=dict)
    order: List[str] = field(default_factory=list)  # names this file itself defines (assignments, defs), in order

    def where(self, node_or_line) -> str:
        line = node_or_line if isinstance(node_or_line, int) else getattr(node_or_line, "lineno", 0)
        return f"{self.name}:{line}"

    def fail(self, node_or_line, message: str, hint: Optional[str] = None) -> "RulesDocError":
        return RulesDocError(self.where(node_or_line), message, hint)

    def lookup(self, name: str, node: ast.AST) -> Any:
        binding = self.bindings.get(name)
        if binding is None:
            if name in _BUILTINS:
                return _BUILTINS[name]
            raise self.fail(node, f"unknown name `{name}`",
                            "rules_doc only knows names defined or loaded in this file and rule/provider/attr/Label/dict/struct/str")
        return self.value_of(name, binding)

    def value_of(self, name: str, binding: _Binding) -> Any:
        if binding.value is not _PENDING:
            return binding.value
        if binding.evaluating:
            raise self.fail(binding.line, f"`{name}` refers to itself")
        binding.evaluating = True
        try:
            if binding.loaded_from is not None:
                module, source_name = binding.loaded_from
                value = module.exported(source_name, self, binding.line)
            else:
                value = _Evaluator(self).eval(binding.node)
                # Like Bazel, a rule or provider takes the name of the global it is first assigned to.
                if isinstance(value, (Rule, Provider)) and value.name is None:
                    value.name = name
        finally:
            binding.evaluating = False
        binding.value = value
        return value

    def exported(self, name: str, importer: "Module", line: int) -> Any:
        """The value of a name another file loads from this one (never a name this file loaded itself)."""
        if name.startswith("_"):
            raise importer.fail(line, f"cannot load private name `{name}` from {self.name}")
        if name not in self.order:
            raise importer.fail(line, f"{self.name} does not define `{name}`")
        return self.value_of(name, self.bindings[name])


class _Loader:
    def __init__(self, root: Path):
        self.root = root
        self.modules: Dict[str, Module] = {}

    def module(self, relative: str) -> Module:
        if relative not in self.modules:
            self.modules[relative] = self._parse(relative)
        return self.modules[relative]

    def _parse(self, relative: str) -> Module:
        path = self.root / relative
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as e:
            raise RulesDocError(relative, f"cannot read the file ({e.strerror})",
                                f"rules_doc reads the .bzl files under {self.root}") from None
        try:
            tree = ast.parse(source, filename=relative)
        except SyntaxError as e:
            raise RulesDocError(f"{relative}:{e.lineno}", f"cannot parse: {e.msg}",
                                "rules_doc parses Starlark as Python; rewrite the construct or extend dsa/tools/rules_doc.py") from None
        module = Module(path=path, name=relative, loader=self)
        # Placeholders first, then the statements: a later load of this module (a cycle) sees no bindings
        # yet, which Bazel would refuse as well.
        for index, statement in enumerate(tree.body):
            self._statement(module, statement, index == 0)
        return module

    def _statement(self, module: Module, node: ast.stmt, first: bool) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a module docstring or a string used as a comment
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id == "load":
            self._load(module, node.value)
            return
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                raise module.fail(node, "cannot evaluate an assignment to anything but one plain name",
                                  "rules_doc evaluates `NAME = expression` only")
            self._bind(module, node.targets[0].id, _Binding(node=node.value, module=module, line=node.lineno))
            return
        if isinstance(node, ast.FunctionDef):
            binding = _Binding(node=None, module=module, line=node.lineno)
            binding.value = Function(node.name, node, module)
            self._bind(module, node.name, binding)
            return
        kind = type(node).__name__
        detail = ast.get_source_segment(module.path.read_text(encoding="utf-8"), node) or kind
        detail = detail.splitlines()[0]
        raise module.fail(node, f"cannot evaluate a top-level {kind} statement: {detail}",
                          "rules_doc understands load(), `NAME = expression`, def and docstrings at the top level")

    def _bind(self, module: Module, name: str, binding: _Binding) -> None:
        if name in module.bindings:
            raise module.fail(binding.line, f"`{name}` is bound twice (first on line {module.bindings[name].line})")
        module.bindings[name] = binding
        if not binding.loaded:
            module.order.append(name)

    def _load(self, module: Module, call: ast.Call) -> None:
        if not call.args or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args) or \
                not all(k.arg and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str) for k in call.keywords):
            raise module.fail(call, "load() takes string literals only")
        label = call.args[0].value
        names = [(a.value, a.value) for a in call.args[1:]] + [(k.arg, k.value.value) for k in call.keywords]
        if label.startswith("@") and not label.startswith("@//"):
            # Another repository's file (rules_python): its names are only named, never evaluated.
            for local, source_name in names:
                binding = _Binding(node=None, module=module, line=call.lineno, loaded=True)
                binding.value = External(source_name, label)
                self._bind(module, local, binding)
            return
        target = self._resolve(module, label, call)
        loaded = self.module(target)
        for local, source_name in names:
            self._bind(module, local, _Binding(node=None, module=module, line=call.lineno,
                                               loaded_from=(loaded, source_name), loaded=True))

    def _resolve(self, module: Module, label: str, node: ast.AST) -> str:
        """A label of this repository (`//rules/private:common.bzl`, `:common.bzl`) as a root-relative path."""
        text = label[1:] if label.startswith("@//") else label
        if text.startswith("//"):
            package, _, name = text[2:].partition(":")
            if not name:
                raise module.fail(node, f"cannot load `{label}`: a .bzl label names its file after `:`")
            relative = f"{package}/{name}" if package else name
        elif text.startswith(":"):
            directory = str(Path(module.name).parent)
            relative = text[1:] if directory == "." else f"{directory}/{text[1:]}"
        else:
            raise module.fail(node, f"cannot load `{label}`: not a label of this repository")
        if not relative.endswith(".bzl"):
            raise module.fail(node, f"cannot load `{label}`: not a .bzl file")
        return relative


@dataclass(frozen=True)
class _Builtin:
    name: str


_BUILTINS = {name: _Builtin(name) for name in ("rule", "provider", "Label", "dict", "struct", "attr", "str")}


class _Evaluator:
    """Evaluates one module-level expression; anything it does not know is an error naming file and line."""

    def __init__(self, module: Module):
        self.module = module

    def fail(self, node: ast.AST, message: str) -> RulesDocError:
        segment = ast.get_source_segment(self.module.path.read_text(encoding="utf-8"), node) or type(node).__name__
        segment = segment.splitlines()[0] + (" ..." if "\n" in segment else "")
        return self.module.fail(node, f"cannot evaluate {message}: {segment}",
                                "extend dsa/tools/rules_doc.py, or keep the construct out of what the reference documents")

    def eval(self, node: ast.AST) -> Any:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise self.fail(node, f"a {type(node).__name__} expression")
        return method(node)

    def _Constant(self, node: ast.Constant):
        if isinstance(node.value, (str, int, bool)) or node.value is None:
            return node.value
        raise self.fail(node, f"a {type(node.value).__name__} literal")

    def _Name(self, node: ast.Name):
        return self.module.lookup(node.id, node)

    def _List(self, node: ast.List):
        return [self.eval(e) for e in node.elts]

    def _Tuple(self, node: ast.Tuple):
        return tuple(self.eval(e) for e in node.elts)

    def _Dict(self, node: ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                raise self.fail(value, "`**` inside a dict literal")
            k = self.eval(key)
            if not isinstance(k, (str, int, LabelValue)):
                raise self.fail(key, "a dict key that is not a string, int or label")
            if k in out:
                raise self.fail(key, f"a dict literal with the key {k!r} twice")
            out[k] = self.eval(value)
        return out

    def _BinOp(self, node: ast.BinOp):
        left, right = self.eval(node.left), self.eval(node.right)
        if isinstance(node.op, ast.Add):
            if type(left) is type(right) and isinstance(left, (str, int, list, tuple)) and not isinstance(left, bool):
                return left + right
            raise self.fail(node, f"`+` of {type(left).__name__} and {type(right).__name__}")
        if isinstance(node.op, ast.Mod) and isinstance(left, str):
            values = right if isinstance(right, tuple) else (right,)
            if not all(isinstance(v, (str, int)) for v in values):
                raise self.fail(node, "`%` with a value that is not a string or int")
            try:
                return left % values
            except (TypeError, ValueError) as e:
                raise self.fail(node, f"`%` ({e})") from None
        raise self.fail(node, f"the operator {type(node.op).__name__}")

    def _Attribute(self, node: ast.Attribute):
        raise self.fail(node, "an attribute access outside a call of attr.*")

    def _Call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "attr" \
                and "attr" not in self.module.bindings:
            if func.attr not in ATTR_KINDS:
                raise self.fail(node, f"attr.{func.attr} (an attribute type rules_doc does not know)")
            if node.args:
                raise self.fail(node, f"attr.{func.attr} with positional arguments")
            return Attr(func.attr, self._kwargs(node), self.module.where(node))
        callee = self.eval(func) if isinstance(func, ast.Name) else None
        if not isinstance(callee, _Builtin):
            name = func.id if isinstance(func, ast.Name) else type(func).__name__
            raise self.fail(node, f"a call of `{name}` (only rule, provider, attr.*, Label, dict, struct and str are known)")
        builtin = callee.name
        if builtin == "Label":
            if len(node.args) != 1 or node.keywords:
                raise self.fail(node, "Label() without exactly one argument")
            label = self.eval(node.args[0])
            if not isinstance(label, str):
                raise self.fail(node, "Label() of something that is not a string")
            return LabelValue(label)
        if builtin == "str":
            # str(Label(...)) (a rule's `toolchains`): the label as written; Bazel would print it resolved.
            if len(node.args) != 1 or node.keywords:
                raise self.fail(node, "str() without exactly one argument")
            value = self.eval(node.args[0])
            if isinstance(value, LabelValue):
                return value.label
            if isinstance(value, str):
                return value
            raise self.fail(node, "str() of something that is neither a string nor a Label")
        if builtin == "dict":
            if len(node.args) > 1:
                raise self.fail(node, "dict() with more than one positional argument")
            out = {}
            if node.args:
                first = self.eval(node.args[0])
                if not isinstance(first, dict):
                    raise self.fail(node.args[0], "dict() of something that is not a dict")
                out.update(first)
            out.update(self._kwargs(node))
            return out
        if node.args:
            raise self.fail(node, f"{builtin}() with positional arguments")
        kwargs = self._kwargs(node)
        if builtin == "struct":
            return Struct(tuple(kwargs.items()))
        if builtin == "provider":
            return Provider(kwargs, self.module.where(node))
        if builtin == "rule":
            return Rule(kwargs, self.module.where(node))
        raise self.fail(node, f"a call of {builtin}")

    def _kwargs(self, node: ast.Call) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                value = self.eval(keyword.value)
                if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                    raise self.fail(keyword.value, "`**` of something that is not a dict with string keys")
                out.update(value)
            else:
                out[keyword.arg] = self.eval(keyword.value)
        return out


# ---- rendering ---------------------------------------------------------------------------------------

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def markdown_text(text: str) -> str:
    """`text` as Markdown shows it: `<` outside code spans escaped (else `<family>` would vanish as an HTML tag)."""
    out, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(text[last:match.start()].replace("<", "&lt;"))
        out.append(match.group(0))
        last = match.end()
    out.append(text[last:].replace("<", "&lt;"))
    return "".join(out)


def cell(text: str) -> str:
    """`text` inside one Markdown table cell: one line, `|` escaped."""
    return markdown_text(" ".join(text.split())).replace("|", "\\|")


def starlark(value: Any) -> str:
    """A value as Starlark source."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, int):
        return str(value)
    if isinstance(value, LabelValue):
        return f"Label({starlark(value.label)})"
    if isinstance(value, External):
        return value.name
    if isinstance(value, (Provider, Rule)):
        return value.name or "<anonymous>"
    if isinstance(value, Function):
        return value.name
    if isinstance(value, list):
        return "[" + ", ".join(starlark(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(starlark(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{starlark(k)}: {starlark(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Struct):
        return "struct(" + ", ".join(f"{k} = {starlark(v)}" for k, v in value.fields) + ")"
    raise TypeError(f"no Starlark form for {value!r}")


def _code(value: Any) -> str:
    text = starlark(value)
    return f"``{text}``" if "`" in text else f"`{text}`"


def _provider_names(providers: Any, where: str) -> str:
    if not isinstance(providers, list):
        raise RulesDocError(where, f"providers must be a list, got {starlark(providers)}")
    groups = providers if providers and all(isinstance(p, list) for p in providers) else [providers]
    return " or ".join(" and ".join(f"`{starlark(p)}`" for p in group) for group in groups)


def _files(value: Any, single: bool) -> str:
    noun = "one file" if single else "files"
    if value is True:
        return noun
    if isinstance(value, list):
        return f"{noun}: " + ", ".join(f"`{v}`" for v in value)
    return f"{noun}: {_code(value)}"


def _allowed(a: Attr) -> str:
    parts = []
    kw = a.kwargs
    if kw.get("allow_single_file") not in (None, False):
        parts.append(_files(kw["allow_single_file"], True))
    if kw.get("allow_files") not in (None, False):
        parts.append(_files(kw["allow_files"], False))
    if kw.get("providers"):
        parts.append("providers: " + _provider_names(kw["providers"], a.where))
    if kw.get("values"):
        parts.append("one of " + ", ".join(_code(v) for v in kw["values"]))
    if kw.get("executable"):
        parts.append("executable")
    if "cfg" in kw:
        parts.append(f"cfg {_code(kw['cfg'])}")
    return "; ".join(parts)


def _default(a: Attr) -> str:
    if a.kwargs.get("mandatory"):
        return "mandatory"
    return "optional, default " + _code(a.kwargs.get("default", ATTR_KINDS[a.kind]))


def _rule_section(name: str, rule: Rule) -> List[str]:
    attrs = rule.kwargs.get("attrs", {})
    if not isinstance(attrs, dict):
        raise RulesDocError(rule.where, f"rule {name}: attrs must be a dict")
    for attr_name, value in attrs.items():
        if not isinstance(value, Attr):
            raise RulesDocError(rule.where, f"rule {name}: attribute `{attr_name}` is not an attr.* value: {starlark(value)}")
    public = sorted(n for n in attrs if not n.startswith("_"))
    lines = [f"### {name}", "", "```starlark", f"{name}({', '.join(['name'] + public)})", "```", ""]
    doc = rule.kwargs.get("doc")
    if doc:
        lines += [markdown_text(inspect.cleandoc(doc)), ""]
    lines += [
        "| attribute | type | mandatory / default | allowed | doc |",
        "|---|---|---|---|---|",
        "| `name` | name | mandatory |  | A unique name for this target. |",
    ]
    for attr_name in public:
        a = attrs[attr_name]
        lines.append(f"| `{attr_name}` | {a.kind} | {_default(a)} | {cell(_allowed(a))} | {cell(a.kwargs.get('doc', ''))} |")
    lines.append("")
    outputs = rule.kwargs.get("outputs")
    if outputs:
        if not isinstance(outputs, dict):
            raise RulesDocError(rule.where, f"rule {name}: outputs must be a dict")
        lines += ["Predeclared outputs: " + ", ".join(f"`{k}` = `{v}`" for k, v in sorted(outputs.items())) + ".", ""]
    provides = rule.kwargs.get("provides")
    if provides:
        lines += ["Provides: " + _provider_names(provides, rule.where) + ".", ""]
    for flag in ("executable", "test"):
        if rule.kwargs.get(flag):
            lines += [f"An {flag} rule (`{flag} = True`).", ""]
    return lines


def _signature(function: Function) -> str:
    args = function.node.args
    if args.posonlyargs or args.kwonlyargs:
        raise function.module.fail(function.node, f"cannot document {function.name}: positional-only or keyword-only parameters")
    evaluator = _Evaluator(function.module)
    params = []
    first_default = len(args.args) - len(args.defaults)
    for i, arg in enumerate(args.args):
        if i >= first_default:
            params.append(f"{arg.arg} = {starlark(evaluator.eval(args.defaults[i - first_default]))}")
        else:
            params.append(arg.arg)
    if args.vararg:
        params.append("*" + args.vararg.arg)
    if args.kwarg:
        params.append("**" + args.kwarg.arg)
    return f"{function.name}({', '.join(params)})"


def _macro_section(name: str, function: Function) -> List[str]:
    signature = _signature(function)
    if function.name != name:
        signature = name + signature[len(function.name):]
    lines = [f"### {name}", "", "```starlark", signature, "```", ""]
    if function.doc:
        lines += [markdown_text(function.doc), ""]
    return lines


def _provider_section(name: str, provider: Provider) -> List[str]:
    lines = [f"### {name}", ""]
    doc = provider.kwargs.get("doc")
    if doc:
        lines += [markdown_text(inspect.cleandoc(doc)), ""]
    fields = provider.kwargs.get("fields")
    if fields is None:
        return lines
    if isinstance(fields, list):
        fields = {f: "" for f in fields}
    if not isinstance(fields, dict):
        raise RulesDocError(provider.where, f"provider {name}: fields must be a list or a dict")
    lines += ["| field | doc |", "|---|---|"]
    lines += [f"| `{f}` | {cell(d)} |" for f, d in fields.items()]
    return lines + [""]


def public_names(root: Optional[Path] = None, relative: str = DEFS) -> List[Tuple[str, Any]]:
    """(name, value) of every public name `relative` (default rules/defs.bzl) defines, in its order."""
    loader = _Loader(Path(root) if root is not None else default_root())
    defs = loader.module(relative)
    out = []
    for name in defs.order:
        if name.startswith("_"):
            continue
        value = defs.value_of(name, defs.bindings[name])
        if not isinstance(value, (Rule, Function, Provider)):
            raise defs.fail(defs.bindings[name].line,
                            f"cannot document `{name}`: not a rule, a macro or a provider ({starlark(value)})",
                            "make it private (`_name`) or extend dsa/tools/rules_doc.py")
        out.append((name, value))
    return out


def render(root: Optional[Path] = None) -> str:
    """The rule reference for the rule set under `root` (the directory holding rules/; default: this checkout)."""
    names = public_names(root)
    kinds = (("Rules", Rule, _rule_section), ("Macros", Function, _macro_section), ("Providers", Provider, _provider_section))
    lines = [
        f"<!-- Generated by {COMMAND}: do not edit by hand. -->",
        "# Rule reference",
        "",
        f"Generated by {COMMAND} from the `doc` strings of {DEFS}, {TESTING} and the files they load: do not edit by hand. "
        "//tests/rules_doc:rules_doc_test fails when this page differs from what the generator prints.",
        "",
        '    load("@rules_dsa//rules:defs.bzl", ' + ", ".join(f'"{n}"' for n, _ in names) + ")",
        "",
    ]
    for title, kind, _ in kinds:
        members = [n for n, v in names if isinstance(v, kind)]
        if members:
            lines.append(f"{title}: " + ", ".join(f"[{n}](#{n.lower()})" for n in members) + ".")
            lines.append("")
    base = Path(root) if root is not None else default_root()
    testing = public_names(root, TESTING) if (base / TESTING).is_file() else []
    if testing:
        lines.append(f"Stand-ins and tests ({TESTING}): " + ", ".join(f"[{n}](#{n.lower()})" for n, _ in testing) + ".")
        lines.append("")
    for title, kind, section in kinds:
        members = [(n, v) for n, v in names if isinstance(v, kind)]
        if not members:
            continue
        lines += [f"## {title}", ""]
        for name, value in members:
            lines += section(name, value)
    if testing:
        doc = inspect.cleandoc(ast.get_docstring(ast.parse((base / TESTING).read_text(encoding="utf-8"))) or "")
        lines += [f"## Stand-ins and tests ({TESTING})", "",
                  '    load("@rules_dsa//rules:testing.bzl", ' + ", ".join(f'"{n}"' for n, _ in testing) + ")", ""]
        if doc:
            # The module docstring's first line is its summary; the rest (the load line above aside) explains.
            summary, _, rest = doc.partition("\n")
            rest = "\n".join(l for l in rest.splitlines() if "load(" not in l).strip("\n")
            lines += [markdown_text(summary), ""] + ([markdown_text(rest), ""] if rest else [])
        for title, kind, section in kinds:
            for name, value in testing:
                if isinstance(value, kind):
                    lines += section(name, value)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa rules-doc", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None,
                        help="directory holding rules/defs.bzl (default: the checkout this dsa package is in)")
    options = parser.parse_args(argv)
    sys.stdout.write(render(options.root))


if __name__ == "__main__":
    run_cli(main, "dsa rules-doc")

"""The script stays a size a reader can hold: sections and functions bounded, the pure
sections free of torch and of the text appendix (read from the source itself)."""
import ast
import io
import pathlib
import tokenize

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "NN_40_serving.py"
SECTION_MAX, FUNCTION_MAX, CLASS_MAX, PARAMETERS_MAX = 500, 60, 300, 6
BANNER = "# " + "-" * 77


def sections():
    """[(title, first line, lines)] of the script, split at its banners."""
    lines = SOURCE.read_text(encoding="utf-8").split("\n")
    starts = [i for i, line in enumerate(lines) if line == BANNER]
    return [(lines[a + 1][2:], a + 1, lines[a:b])
            for a, b in zip(starts, starts[1:] + [len(lines)])]


def code_names(lines):
    """The names the code uses (comments, strings and docstrings left out)."""
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_the_script_has_its_sections_in_reading_order():
    # (a section is what a reader holds at once; their number follows the script's reach)
    titles = [title.split(":")[0] for title, _, _ in sections()]
    assert len(titles) <= 32
    order = ["step costs",
             "model", "timing",
             "experiments A and B", "experiment C", "experiment D", "tables", "figures",
             "flags", "the run", "text"]
    assert [t for t in titles if t in order] == [t for t in order if t in titles]


def test_no_section_is_longer_than_a_reader_holds():
    long = {title: len(lines) for title, _, lines in sections() if len(lines) > SECTION_MAX}
    assert not long


def test_no_function_is_longer_than_sixty_lines():
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= FUNCTION_MAX}
    assert not long


def test_no_class_is_longer_than_a_section_of_its_own():
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= CLASS_MAX}
    assert not long


def parameters(node):
    """A function's parameters, self and cls left out."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p]
    return [n for n in names if n not in ("self", "cls")]


def test_few_functions_take_over_six_parameters():
    # (a long argument list wants the value the call already has: a config, a shape, a record)
    many = {(path.name, node.name): len(parameters(node))
            for path in [SOURCE, *sorted((SOURCE.parent / "nn40").glob("*.py"))]
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and len(parameters(node)) > PARAMETERS_MAX}
    assert len(many) <= 3, many
    assert parameters(ast.parse("def f(self, a, *b, c=1, **d): pass").body[0]) == \
        ["a", "c", "b", "d"]


def test_the_structure_checks_can_fail():
    # the checks above read what they claim to: a torch call in a pure section is seen
    assert "torch" in code_names(["x = torch.zeros(3)  # torch"])
    assert "torch" not in code_names(["x = 1  # torch", "'''torch'''"])
    assert any(len(lines) > 100 for _, _, lines in sections())


def test_the_readme_names_every_section_and_which_are_pure():
    readme = (SOURCE.parent / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Reading the code", 1)[1].split("\n## ", 1)[0]
    named = {}
    for line in layout.splitlines():
        first = line.split("|")[1].strip() if line.startswith("| ") else ""
        if first and first not in ("section", "module") and not first.startswith("`nn40/"):
            pure = first.endswith("*pure*")
            for name in first.replace("*pure*", "").replace(";", ",").split(","):
                named[name.strip()] = pure
    for title, _, _ in sections():
        short = title.split(":")[0]
        assert short in named, short
        assert named[short] == ("(pure" in title), short
    assert len(named) == len(sections())


def test_no_top_level_name_is_defined_twice():
    # (a second `def percentiles` further down silently replaces the first for every caller)
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    names = [node.name for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert not {name for name in names if names.count(name) > 1}


# --- the package beside the script ---------------------------------------------------------
PACKAGE = SOURCE.parent / "nn40"
# the package's modules in their import order: each may import only those before it (and
# never the script); none imports torch or matplotlib
LAYERS = ["errors", "traces", "config", "host", "accounting", "workload", "slot_steps", "stats",
          "queues", "kv", "settings", "names", "replicas", "loop", "pricing", "profiles",
          "memory", "published", "metrics", "routers", "events", "handoff", "pools",
          "disaggregated", "runs", "capacity", "experiment_c", "calibration", "text",
          "text_ko"]
MODULE_MAX = 900


def modules():
    return {path.stem: path for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"}


def imported(text):
    """The package modules and the top-level libraries a module's source imports."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found |= {n.split(".")[1] if n.startswith("nn40.") else n.split(".")[0] for n in names}
    return found


def test_the_packages_modules_are_layered_and_light():
    assert set(modules()) == set(LAYERS)  # (a new module takes its place in LAYERS)
    for i, name in enumerate(LAYERS):
        uses = imported(modules()[name].read_text(encoding="utf-8"))
        assert not uses & {"torch", "matplotlib", "NN_40_serving"}, name
        assert not uses & set(LAYERS[i:]), f"{name} imports a module at or above its layer"
    # (the scan sees what a wrong import would be)
    assert imported("import torch.nn\nfrom nn40.traces import read_named_trace") == \
        {"torch", "traces"}


def test_importing_the_package_loads_no_torch():
    import subprocess
    import sys
    code = ("import sys; import " + ", ".join(f"nn40.{name}" for name in LAYERS) + "; "
            "assert not {'torch', 'matplotlib'} & set(sys.modules), 'torch or matplotlib loaded'")
    subprocess.run([sys.executable, "-c", code], cwd=SOURCE.parent, check=True)


def test_the_readme_names_every_module_of_the_package():
    readme = (SOURCE.parent / "README.md").read_text(encoding="utf-8")
    listed = [line.split("|")[1].strip() for line in readme.split("\n")
              if line.startswith("| `nn40/")]
    assert listed == [f"`nn40/{name}.py`" for name in LAYERS]


def test_the_packages_modules_keep_the_scripts_guards():
    for name, path in modules().items():
        text = path.read_text(encoding="utf-8")
        assert len(text.split("\n")) <= MODULE_MAX, name
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < FUNCTION_MAX, (name, node.name)
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < CLASS_MAX, (name, node.name)

"""The code stays a size a reader can hold: the script an entry of at most 800 lines, the
package's modules one concept each, layered in one import order with no cycle, the simulator
free of torch and matplotlib (read from the sources themselves)."""
import ast
import io
import pathlib
import subprocess
import sys
import tokenize

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "NN_40_serving.py"
PACKAGE = SOURCE.parent / "nn40"
SCRIPT_MAX, MODULE_MAX, FUNCTION_MAX, CLASS_MAX, PARAMETERS_MAX = 800, 900, 60, 300, 6

# the package's modules in their import order: each may import only those before it (and
# never the script); the simulator (everything experiment C, the capacity answer, the
# DistServe replay and the placement search need) imports neither torch nor matplotlib
SIMULATOR = ["errors", "traces", "config", "host", "accounting", "workload", "slot_steps",
             "stats", "queues", "tiers", "kv", "settings", "names", "replicas", "loop", "pricing",
             "speculative", "profiles", "stages", "memory", "published", "metrics", "routers",
             "events", "handoff", "pools", "runs", "capacity", "speculative_study", "placement",
             "cheapest",
             "disaggregated", "experiment_c",
             "calibration"]
# the report: the text, the tables and the figures (matplotlib loaded where one is drawn)
REPORT = ["text", "text_ko", "tables", "tables_c", "figures"]
# the device code: the model and what times it (torch)
DEVICE = ["model", "device", "timing", "experiment_ab", "experiment_d", "engine_check"]
# the modes (runs other than the experiments: none needs torch), and the command line (it
# loads the device code only when A, B or D runs)
LAYERS = SIMULATOR + REPORT + ["modes"] + DEVICE + ["cli"]


def modules():
    return {path.stem: path for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"}


def sources():
    """The script and every module of the package: [(name, source text)]."""
    return [(SOURCE.name, SOURCE.read_text(encoding="utf-8"))] + \
        [(path.name, path.read_text(encoding="utf-8")) for path in modules().values()]


def imported(text, top_level_only=False):
    """The package modules and the top-level libraries a module's source imports (at its top
    level alone, or anywhere, a function's lazy import included)."""
    found = set()
    nodes = ast.parse(text).body if top_level_only else ast.walk(ast.parse(text))
    for node in nodes:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found |= {n.split(".")[1] if n.startswith("nn40.") else n.split(".")[0] for n in names}
    return found


def functions_and_classes():
    for name, text in sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                yield name, node


def parameters(node):
    """A function's parameters, self and cls left out."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p]
    return [n for n in names if n not in ("self", "cls")]


def test_the_script_is_the_entry_alone():
    # (parse, dispatch the modes, run, finish: everything else lives in the package)
    lines = SOURCE.read_text(encoding="utf-8").split("\n")
    assert len(lines) <= SCRIPT_MAX
    assert {path.name for path in SOURCE.parent.iterdir() if not path.name.startswith(".")
            and path.name != "__pycache__"} <= {"NN_40_serving.py", "README.md",
                                                "requirements.txt", "figures", "tests", "nn40",
                                                "pytest.ini"}


def test_no_module_is_longer_than_one_concept():
    long = {name: text.count("\n") for name, text in sources()[1:]
            if text.count("\n") > MODULE_MAX}
    assert not long


def test_no_function_is_longer_than_sixty_lines():
    long = {(name, node.name): node.end_lineno - node.lineno + 1
            for name, node in functions_and_classes()
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= FUNCTION_MAX}
    assert not long


def test_no_class_is_longer_than_three_hundred_lines():
    long = {(name, node.name): node.end_lineno - node.lineno + 1
            for name, node in functions_and_classes()
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= CLASS_MAX}
    assert not long


def test_few_functions_take_over_six_parameters():
    # (a long argument list wants the value the call already has: a config, a shape, a record)
    many = {(name, node.name): len(parameters(node)) for name, node in functions_and_classes()
            if isinstance(node, ast.FunctionDef) and len(parameters(node)) > PARAMETERS_MAX}
    assert len(many) <= 3, many
    assert parameters(ast.parse("def f(self, a, *b, c=1, **d): pass").body[0]) == \
        ["a", "c", "b", "d"]


def test_no_top_level_name_is_defined_twice():
    # (a second `def percentiles` further down silently replaces the first for every caller)
    for name, text in sources():
        defined = [node.name for node in ast.parse(text).body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        assert not {d for d in defined if defined.count(d) > 1}, name


def test_the_packages_modules_are_layered():
    # each imports only the modules before it, so there is no cycle; none imports the script
    assert set(modules()) == set(LAYERS)  # (a new module takes its place in LAYERS)
    for i, name in enumerate(LAYERS):
        uses = imported(modules()[name].read_text(encoding="utf-8"))
        assert "NN_40_serving" not in uses, name
        assert not uses & set(LAYERS[i:]), f"{name} imports a module at or above its layer"
        if name in SIMULATOR:
            assert not uses & {"torch", "matplotlib"}, name
        if name not in DEVICE:  # (the report and the command line: torch never, or lazily)
            assert "torch" not in imported(modules()[name].read_text(encoding="utf-8"),
                                           top_level_only=True), name


def test_the_layering_checks_can_fail():
    # the scan sees a lazy import, a torch import and a module's name
    assert imported("def f():\n    from nn40.device import x\nimport torch.nn") == \
        {"device", "torch"}
    assert imported("def f():\n    from nn40.device import x\n", top_level_only=True) == set()
    assert LAYERS.index("cli") > LAYERS.index("device")  # (cli's lazy import is allowed)


def loaded(code):
    """The libraries loaded by running code in a fresh Python, in the script's folder."""
    out = subprocess.run([sys.executable, "-c", code + "; import sys; print(' '.join("
                          "n for n in ('torch', 'matplotlib') if n in sys.modules))"],
                         cwd=SOURCE.parent, check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_importing_the_simulator_loads_neither_torch_nor_matplotlib():
    # (what a Dask worker imports to run C's and the placement search's simulations)
    assert loaded("import " + ", ".join(f"nn40.{name}" for name in SIMULATOR)) == set()
    assert loaded("import nn40.tables, nn40.tables_c, nn40.figures, nn40.modes, nn40.cli") == \
        set()
    assert loaded("import nn40.model") == {"torch"}  # (the check sees a load)


def test_the_readme_names_every_module_and_what_it_imports():
    readme = (SOURCE.parent / "README.md").read_text(encoding="utf-8")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in readme.split("\n")
            if line.startswith("| `nn40/")]
    assert [row[0] for row in rows] == [f"`nn40/{name}.py`" for name in LAYERS]
    for row, name in zip(rows, LAYERS):
        uses = [m for m in LAYERS if m in imported(modules()[name].read_text(encoding="utf-8"))]
        assert row[2] == (", ".join(f"`{m}`" for m in uses) or "-"), name


def code_names(text):
    """The names the code uses (comments, strings and docstrings left out)."""
    tokens = tokenize.generate_tokens(io.StringIO(text + "\n").readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_the_simulator_prints_nothing_itself():
    # (every printed string lives in the report's text, in both languages)
    for name in SIMULATOR:
        assert not {"TEXT", "TEXT_EN", "describe"} & \
            code_names(modules()[name].read_text(encoding="utf-8")), name
    assert "TEXT" in code_names("x = TEXT['en']  # TEXT") and \
        "TEXT" not in code_names("x = 1  # TEXT\n'''TEXT'''")


def test_experiment_c_runs_in_a_python_without_torch(tmp_path):
    # (torch made unimportable: the run must never reach for it, and still write its results)
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['NN_40_serving.py', "
            f"'--experiments', 'C', '--requests', '300', '--no-figures', '--out', r'{tmp_path}']; "
            "runpy.run_path('NN_40_serving.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=SOURCE.parent, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "results.json").exists()
    # (the check can fail: A needs torch, and the blocked import is seen)
    code = code.replace("'C', '--requests', '300'", "'AC'")
    done = subprocess.run([sys.executable, "-c", code], cwd=SOURCE.parent, capture_output=True,
                          text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "experiments A run the model on torch, which does not import here" in done.stderr

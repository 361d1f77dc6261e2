"""The code interpreter through the official Python SDK, e2b-code-interpreter
(PyPI; e2e_py_new only: it needs e2b >= 2.55.1): Sandbox.create() of its
default template (code-interpreter-v1), run_code in Python with streamed
output, rich results, errors, contexts, a timeout that interrupts, and the
JavaScript, TypeScript and bash contexts; the async client too."""

import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox, TimeoutException


@pytest.fixture(scope="module")
def ci(server):
    s = Sandbox.create(timeout=600)
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_state_results_and_streamed_output(ci):
    assert ci.run_code("x = 6\nx * 7").text == "42"
    out, err = [], []
    e = ci.run_code('import sys\nprint("to out")\nprint("to err", file=sys.stderr)\nx + 1',
                    on_stdout=lambda m: out.append(m.line), on_stderr=lambda m: err.append(m.line))
    assert e.text == "7"
    assert e.logs.stdout == ["to out\n"] and out == ["to out\n"]
    assert e.logs.stderr == ["to err\n"] and err == ["to err\n"]
    assert e.execution_count >= 2


def test_plot_dataframe_and_error(ci):
    e = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([0, 1, 2], [0, 1, 4])\nplt.title('sq')\nplt.show()")
    fig = next(r for r in e.results if r.png)
    assert fig.chart is not None and fig.chart.type.value == "line"
    assert fig.chart.title == "sq"
    assert [tuple(p) for p in fig.chart.elements[0].points] == [(0, 0), (1, 1), (2, 4)]
    e = ci.run_code("import pandas as pd\npd.DataFrame({'n': [1, 2, 3]})")
    assert "<table" in e.results[0].html
    e = ci.run_code("raise ValueError('bad value')")
    assert e.error.name == "ValueError"
    assert e.error.value == "bad value"
    assert "ValueError" in e.error.traceback


def test_contexts_restart_and_languages(ci):
    a = ci.create_code_context()
    b = ci.create_code_context(language="python", cwd="/tmp")
    ci.run_code("mine = 1", context=a)
    assert ci.run_code("mine", context=b).error.name == "NameError"
    ci.restart_code_context(a)
    assert ci.run_code("mine", context=a).error.name == "NameError"
    assert {c.id for c in ci.list_code_contexts()} >= {a.id, b.id}
    ci.remove_code_context(b)
    js = ci.create_code_context(language="javascript")
    assert ci.run_code("let k = 5; k * 3", context=js).text == "15"
    ts = ci.create_code_context(language="typescript")
    assert ci.run_code("const t: string = 'ty'; t + 'pe'", context=ts).text == "'type'"
    assert "".join(ci.run_code("echo bash says hi", language="bash").logs.stdout) == "bash says hi\n"


def test_timeout_interrupts_and_the_context_goes_on(ci):
    ctx = ci.create_code_context()
    ci.run_code("kept = 3", context=ctx)
    with pytest.raises(TimeoutException):
        ci.run_code("while True:\n    pass", context=ctx, timeout=1.5)
    assert ci.run_code("kept * 2", context=ctx, timeout=30).text == "6"


async def test_async_sandbox(server):
    s = await AsyncSandbox.create(timeout=300)
    try:
        e = await s.run_code("sum(range(10))")
        assert e.text == "45"
        e = await s.run_code("print('async out')")
        assert e.logs.stdout == ["async out\n"]
    finally:
        await s.kill()

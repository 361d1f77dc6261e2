"""Template builds (issue 19) through the Python SDK's builder:
Template.build() from base with ENV, RUN, COPY (a file upload), WORKDIR,
USER and a start command with its ready command; Sandbox.create() of the
result runs them; Template.exists; a failing step is a BuildException that
names the exit status."""

import os
import tempfile
import uuid

import pytest
from e2b import BuildException, Sandbox, Template


def test_build_from_base_and_create(server):
    name = "py-tpl-" + uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory() as ctx:
        with open(os.path.join(ctx, "data.txt"), "w") as f:
            f.write("uploaded by python\n")
        logs = []
        tpl = (
            Template(file_context_path=ctx)
            .from_template("base")
            .set_envs({"PY_VAR": "from python"})
            .run_cmd("mkdir -p /srv && echo served-py > /srv/index.html", user="root")
            .copy("data.txt", "/opt/data.txt")
            .set_workdir("/opt")
            .set_user("user")
            .run_cmd("id -un > /opt/who.txt || id -un > /home/user/who.txt")
            .set_start_cmd("python3 -m http.server 8001 --bind 127.0.0.1 --directory /srv",
                           "curl -sf http://127.0.0.1:8001/ >/dev/null")
        )
        Template.build(tpl, name, on_build_logs=lambda e: logs.append(e.message))
    assert any(m.startswith("RUN mkdir -p /srv") for m in logs), logs
    assert Template.exists(name)
    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run("cat /opt/data.txt").stdout == "uploaded by python\n"
        assert sbx.commands.run('echo "$PY_VAR"').stdout == "from python\n"
        assert sbx.commands.run("curl -s http://127.0.0.1:8001/").stdout == "served-py\n"
    finally:
        sbx.kill()


def test_failing_step_is_a_build_exception(server):
    with pytest.raises(BuildException, match="exit status 7"):
        Template.build(Template().from_template("base").run_cmd("exit 7"), "py-fail-" + uuid.uuid4().hex[:8])


def test_a_tagged_build_runs_by_name_and_tag(server):
    name = "py-tag-" + uuid.uuid4().hex[:8]
    Template.build(Template().from_template("base").run_cmd("echo one > /tmp/v"), name)
    Template.build(Template().from_template("base").run_cmd("echo two > /tmp/v"), name + ":v2")
    for ref, want in ((name, "one\n"), (name + ":default", "one\n"), (name + ":v2", "two\n")):
        sbx = Sandbox.create(ref)
        try:
            assert sbx.commands.run("cat /tmp/v").stdout == want, ref
        finally:
            sbx.kill()

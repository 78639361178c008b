"""Actor options: each class's model checks its spec's options; [shared] settings are stated once."""
import pytest

from postrain.core import ActorSpec, ConfigError, Supervisor, parse_config, resolve_options
from postrain.core.testing import async_test

ECHO = "postrain.core.testing:EchoActor"
DRIVER = "postrain.core.testing:CountingDriver"


def config(shared=None, **options_by_actor):
    actors = [{"name": name, "cls": ECHO if name.startswith("echo") else DRIVER, "options": options}
              for name, options in options_by_actor.items()]
    return parse_config({"shared": shared or {}, "actors": actors})


def test_shared_settings_reach_every_actor_that_declares_them_and_only_those():
    run = config({"steps": 7}, echo={}, driver={"peer": "echo"})
    resolve_options(run)
    assert run.actors[0].options == {}
    assert run.actors[1].options == {"peer": "echo", "steps": 7}


def test_every_bad_option_of_every_actor_is_named_at_once():
    run = config({"stepz": 1}, echo={"fail_setup": "maybe"}, driver={"peer": "echo", "step_ss": 1})
    with pytest.raises(ConfigError) as info:
        resolve_options(run)
    message = str(info.value)
    assert "actors.0(echo).options.fail_setup = 'maybe': Input should be a valid boolean" in message
    assert "actors.1(driver).options.step_ss = 1: unknown field (check the spelling" in message
    assert "shared.stepz = 1: no actor declares an option of that name" in message


def test_a_setting_stated_both_in_shared_and_by_an_actor_is_refused():
    with pytest.raises(ConfigError, match=r"actors.1\(driver\).options.steps: also set in \[shared\]"):
        resolve_options(config({"steps": 2}, echo={}, driver={"peer": "echo", "steps": 3}))


def test_an_import_path_that_names_no_actor_class_is_reported_with_the_options():
    run = parse_config({"actors": [{"name": "x", "cls": "postrain.core.testing:async_test"},
                                   {"name": "y", "cls": "postrain.no_such_module:Thing"}]})
    with pytest.raises(ConfigError) as info:
        resolve_options(run)
    assert "actors.0(x).cls = 'postrain.core.testing:async_test': postrain.core.testing:async_test is not " \
           "an Actor subclass" in str(info.value)
    assert "actors.1(y).cls = 'postrain.no_such_module:Thing': cannot import postrain.no_such_module" \
           in str(info.value)


@async_test
async def test_an_actor_started_without_the_heads_check_still_refuses_a_misspelt_option():
    async with Supervisor.open() as sup:
        with pytest.raises(Exception, match=r"options.fail_setpu = True: unknown field"):
            await sup.start(ActorSpec(name="echo", cls=ECHO, options={"fail_setpu": True}, max_restarts=0,
                                      memory_mb=0, cpus=0.1))

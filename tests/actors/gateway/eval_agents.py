"""Small agents for `postrain eval` tests (test_agent_eval.py): plain `openai` client code, no framework."""
from postrain.actors import AgentEnvironment, Reward


class TwoCallAgent(AgentEnvironment):
    """Asks twice (the second call continues the first), scores 1 when the task's answer is even.
    Task 2 raises: a failed episode."""

    @classmethod
    def eval_tasks(cls, options):
        return [{"question": f"What is {i} + {i}?", "answer": i * 3, "index": i} for i in range(4)]

    async def run(self, client, task) -> Reward:
        messages = [{"role": "user", "content": task["question"]}]
        reply = await client.chat.completions.create(model=self.model, messages=messages, max_tokens=3,
                                                     temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Are you sure?"}]
        await client.chat.completions.create(model=self.model, messages=messages, max_tokens=3, temperature=0)
        if task["index"] == 2:
            raise RuntimeError("this agent fails on task 2")
        return Reward({"correct": float(task["answer"] % 2 == 0)})

"""Fixed texts of the agent protocol: role tags, the system prompt, the summary instruction q_sum and the resume
template u_resume(S) (docs/design.md §1, Eqs. 8–9).

Every turn the policy generates ends with ``EOS``. Each piece of context *ends* with the assistant tag, so the
tag is context (provenance of the piece it ends) and the policy's sampled tokens are exactly its action or
summary text plus ``EOS``.
"""
SYSTEM_TAG = "<|system|>"
USER_TAG = "<|user|>"
ASSISTANT_TAG = "<|assistant|>"
OBSERVATION_TAG = "<|observation|>"
SUMMARY_TAG = "<|summary|>"
EOS = "<|end|>"
PAD = "<|pad|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (PAD, UNK, EOS, SYSTEM_TAG, USER_TAG, ASSISTANT_TAG, OBSERVATION_TAG, SUMMARY_TAG)

SYSTEM_PROMPT = (
    f"{SYSTEM_TAG} you are an agent . use the console : next shows the next item , "
    "submit followed by the answer ends the task ."
)
SUMMARY_INSTRUCTION = (
    f"{USER_TAG} context is full . write a short summary of every fact needed to finish the task . "
    f"{SUMMARY_TAG}"
)
RESUME_PREFIX = f"{USER_TAG} summary of earlier work :"
RESUME_SUFFIX = f"continue the task . {ASSISTANT_TAG}"


def format_task(task_text: str) -> str:
    """The task prompt u as the policy sees it."""
    return f"{USER_TAG} {task_text} {ASSISTANT_TAG}"


def format_observation(observation: str) -> str:
    """An environment observation o_i, ending with the assistant tag that opens the next action."""
    return f"{OBSERVATION_TAG} {observation} {ASSISTANT_TAG}"

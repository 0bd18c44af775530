"""The exception tree of the pipeline.

    PipelineError
    ├── ConfigError              fatal: a config value, file or flag is wrong (names the field)
    ├── FatalError               the run cannot go on; shutdown checkpoints and exits
    │   ├── EngineDeadError      an engine stopped working; the run's error once none is left (restarts spent)
    │   ├── AdapterError         a published adapter cannot be used
    │   │   ├── AdapterNotFoundError    no such version in the store
    │   │   └── AdapterCorruptError     manifest or file hashes do not match
    │   ├── StoreError           the adapter store cannot be written (disk full, permissions)
    │   └── TrainerError         the trainer failed (e.g. repeated non-finite losses)
    └── RecoverableError         one unit of work failed; it is counted, logged and the run goes on
        ├── GenerationError      one engine call failed or timed out
        ├── RewardError          a reward function raised or returned a bad value
        ├── PromptError          a malformed prompt (empty, too long, ...) refused on its own, with a reason
        └── EnvError             an environment's reset or step raised, timed out or answered nonsense: its
                                 group fails (pipeline.envs; EnvTimeoutError for the timeout)

Recoverable errors are caught by the orchestrator where fault tolerance is deliberate; every
other exception ends the run with that error.
"""


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose."""


class ConfigError(PipelineError):
    """A configuration value is wrong. The message names the field and what is allowed."""


class FatalError(PipelineError):
    """The run cannot continue."""


class EngineDeadError(FatalError):
    """An engine stopped working."""


class AdapterError(FatalError):
    """A published adapter cannot be used."""


class AdapterNotFoundError(AdapterError):
    """The requested version is not in the adapter store."""


class AdapterCorruptError(AdapterError):
    """An adapter directory's manifest or file hashes do not match its contents."""


class StoreError(FatalError):
    """The adapter store could not be written."""


class TrainerError(FatalError):
    """The trainer failed."""


class RecoverableError(PipelineError):
    """One unit of work failed; the run goes on."""


class GenerationError(RecoverableError):
    """One engine call failed or timed out."""


class RewardError(RecoverableError):
    """A reward function raised or returned a value that is not a finite float.

    `function` names it; the function's own exception, if it raised, is `__cause__`."""

    def __init__(self, message: str, function: str = "") -> None:
        super().__init__(message)
        self.function = function


class PromptError(RecoverableError):
    """A prompt was refused (malformed, empty, longer than the model's context, no chat template).

    `reason` is a short code counted per run (see pipeline.data.prompts.REASONS)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason

"""The error tree. Library code raises these; only the CLI and the TUI turn them into exit codes
or notifications. Every message says what is wrong and what to do, on one line."""


class EdgerunError(Exception):
    """Base of every error edgerun reports to a user."""

    exit_code = 1


class UnknownModel(EdgerunError):
    """A name that is neither in the catalog, nor a file, nor an hf:// URI."""


class ModelNotFound(EdgerunError):
    """A catalog model that is not downloaded, or a path that does not exist."""


class InvalidModelFile(EdgerunError):
    """A file that is not a well-formed GGUF edgerun can run."""


class FetchError(EdgerunError):
    """Every source of a model failed."""


class ChecksumMismatch(FetchError):
    """A downloaded file whose sha256 is not the catalog's."""


class DiskFull(FetchError):
    """Not enough free space to store a model."""


class ConfigError(EdgerunError):
    """Settings that cannot work together (e.g. a context larger than the model supports)."""

    exit_code = 2


class DoesNotFit(ConfigError):
    """A placement that needs more memory than is free (a smaller context may fit)."""


class EngineError(EdgerunError):
    """llama.cpp refused to load or run something."""


class VocabMismatch(ConfigError):
    """A draft model whose vocabulary differs from the target's."""


class HistoryError(EdgerunError):
    """The conversation history database cannot be opened, read or written."""


class HistoryUnreadable(HistoryError):
    """A history file that is damaged or is not an edgerun history (another program's database,
    not a database at all): moving it aside lets edgerun start a new one."""


class ConvertError(EdgerunError):
    """A model that edgerun convert cannot read, plan or write (unsupported architecture, pickled
    weights, a budget no plan fits)."""

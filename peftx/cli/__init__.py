"""The `peftx` command: fine-tune, inspect, merge and generate from the shell."""

from ._common import model_dir as model_dir
from ._main import main as main

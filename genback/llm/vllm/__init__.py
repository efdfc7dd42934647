"""The vLLM runner: ``AsyncLLM`` on the model's own loop thread (:mod:`.engine`), one vLLM request
per distinct query (:mod:`.runner`), one streamed request per generation (:mod:`.stream`), and the
shared-memory row tap that vLLM's workers import (:mod:`.tap`). Importing this package does not
import vLLM."""

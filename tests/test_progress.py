"""ringpack.progress: counting from several threads."""

import io
import threading

from ringpack.progress import Progress


def test_updates_from_several_threads_all_count():
    bar = Progress("writing", "items", 4 * 20_000, stream=io.StringIO())  # not a terminal: no bar
    start = threading.Barrier(4)

    def work():
        start.wait()
        for _ in range(20_000):
            bar.update(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar.done == 4 * 20_000

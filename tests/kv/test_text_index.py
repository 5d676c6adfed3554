"""The text index finds every stored text a scan of every segment finds, at any offset."""

import random

from kvcomm_agents.kv.text_index import GRAM, TextIndex


def test_texts_in_matches_a_scan_of_every_stored_text_through_adds_and_removals():
    rng = random.Random(0)
    words = ["To solve", " this", " we add", " 12", " and 30", ".", " The answer is", " 42", "\n", " so"]

    def sentence(n: int) -> str:
        return "".join(rng.choice(words) for _ in range(n))

    index, held = TextIndex(), {}
    for step in range(400):
        if held and rng.random() < 0.3:
            key = rng.choice(sorted(held))
            index.remove(key)
            del held[key]
        else:
            key, fingerprint = f"s{step % 50}", rng.choice(["m1", "m2"])
            text = sentence(rng.randrange(1, 9))  # short ones (under 2 * GRAM - 1 characters) too
            index.add(key, fingerprint, text, f"h{hash(text) % 7}")
            held[key] = (fingerprint, text)
        for _ in range(3):
            fingerprint, min_chars = rng.choice(["m1", "m2"]), rng.choice([1, 2, 20])
            around = sentence(rng.randrange(0, 30))
            if held and rng.random() < 0.7:  # embed a stored text at a random offset
                inner = held[rng.choice(sorted(held))][1]
                cut = rng.randrange(len(around) + 1)
                around = around[:cut] + inner + around[cut:]
            expected = {t for fp, t in held.values() if fp == fingerprint and len(t) >= min_chars and t in around}
            assert set(index.texts_in(around, fingerprint, min_chars)) == expected
        for key, (fingerprint, text) in held.items():
            assert key in index.with_text(text, fingerprint)
            assert key in index.with_hash(f"h{hash(text) % 7}", fingerprint)


def test_a_text_held_by_two_segments_stays_findable_until_both_go():
    index, long_text = TextIndex(), "x" * (3 * GRAM) + " the reply's last words"
    index.add("a", "m", long_text, "h")
    index.add("b", "m", long_text, "h")
    index.remove("a")
    assert index.texts_in("before " + long_text + " after", "m") == [long_text]
    assert index.with_text(long_text, "m") == ["b"] and index.with_hash("h", "m") == ["b"]
    index.remove("b")
    assert index.texts_in("before " + long_text, "m") == [] and index.with_text(long_text, "m") == []

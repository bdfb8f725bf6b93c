"""The built-in text corpus that benchmark prompts are cut from.

Original paragraphs of prose, dialogue, code and reference text, so that prompts look like what
users send (varied vocabulary, punctuation, indentation) rather than one token repeated.
"""
from __future__ import annotations

PARAGRAPHS: tuple[str, ...] = (
    "The harbour town woke slowly. Fishing boats knocked against the pier while gulls argued "
    "over the morning catch, and the baker on Quay Street propped his door open so the smell "
    "of rye bread drifted down to the water. By eight o'clock the ferry from the mainland had "
    "unloaded a crate of oranges, two cyclists and a retired schoolteacher who had come to "
    "count the puffins on the northern cliffs.",

    "\"Did you check the logs before you restarted it?\" Maya asked.\n"
    "\"I looked at the last hundred lines,\" said Theo. \"Nothing but timeouts.\"\n"
    "\"Timeouts from which service?\"\n"
    "\"The cache, I think. Or the thing in front of the cache.\"\n"
    "Maya sighed and pulled her chair closer. \"Let's start from the first error, not the "
    "loudest one.\"",

    "def merge_intervals(intervals):\n"
    "    \"\"\"Merge overlapping [start, end] pairs; the input need not be sorted.\"\"\"\n"
    "    merged = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged",

    "Photosynthesis turns light into chemical energy. Inside the chloroplast, pigments absorb "
    "photons and use their energy to split water, releasing oxygen as a by-product. The "
    "electrons freed in that step travel along a chain of proteins, pumping protons across a "
    "membrane; the resulting gradient drives an enzyme that makes ATP, much as falling water "
    "turns a mill wheel.",

    "To replace a bicycle inner tube, first release the brake so the wheel can pass between "
    "the pads. Open the quick-release lever, lift the wheel out and let any remaining air "
    "escape through the valve. Work a tyre lever under the bead opposite the valve, hook it "
    "onto a spoke, then run a second lever around the rim until one side of the tyre is free.",

    "Customer: Hi, my order arrived yesterday but the blue mug is cracked along the handle.\n"
    "Agent: I'm sorry to hear that! Could you share your order number and a photo of the "
    "damage?\n"
    "Customer: Sure, it's 48213. Photo attached.\n"
    "Agent: Thank you. I've arranged a replacement at no charge; it should ship within two "
    "working days, and you don't need to send the broken one back.",

    "SELECT c.region, COUNT(*) AS orders, ROUND(AVG(o.total), 2) AS average_total\n"
    "FROM orders AS o\n"
    "JOIN customers AS c ON c.id = o.customer_id\n"
    "WHERE o.created_at >= DATE '2024-01-01'\n"
    "GROUP BY c.region\n"
    "HAVING COUNT(*) > 50\n"
    "ORDER BY average_total DESC;",

    "In the winter of 1816, which Europeans later called the year without a summer, frost "
    "killed crops in June and snow fell in parts of New England during July. The cause lay "
    "half a world away: the eruption of Mount Tambora in the Dutch East Indies had thrown so "
    "much ash and sulphur into the stratosphere that sunlight dimmed across the northern "
    "hemisphere for more than a year.",

    "Grandmother's lentil soup needs no recipe card. Soften an onion, two carrots and a stick "
    "of celery in olive oil, add a spoon of cumin and let it sizzle until the kitchen smells "
    "warm. Stir in a cup of red lentils, a tin of tomatoes and enough stock to cover by two "
    "fingers, then simmer until the lentils collapse. Finish with lemon juice and plenty of "
    "black pepper.",

    "async function fetchWithRetry(url, attempts = 3) {\n"
    "  for (let i = 0; i < attempts; i++) {\n"
    "    try {\n"
    "      const response = await fetch(url);\n"
    "      if (response.ok) return await response.json();\n"
    "    } catch (err) {\n"
    "      console.warn(`attempt ${i + 1} failed: ${err.message}`);\n"
    "    }\n"
    "    await new Promise((r) => setTimeout(r, 250 * 2 ** i));\n"
    "  }\n"
    "  throw new Error(`giving up on ${url}`);\n"
    "}",

    "A hash table stores values in an array of buckets and uses a hash function to pick the "
    "bucket for each key. When two keys land in the same bucket, the table must resolve the "
    "collision, either by chaining entries in a small list or by probing for the next free "
    "slot. Lookups stay fast on average as long as the table is resized before it becomes "
    "too full.",

    "The committee met on Thursday to review the draft budget. Members agreed to keep the "
    "library open on Sunday afternoons through the spring, to postpone the roof repairs until "
    "a second quote arrives, and to ask the youth football club whether it could share the "
    "cost of new floodlights. The minutes will be posted on the notice board next week.",

    "\"You're late,\" said the lighthouse keeper, not looking up from his chessboard.\n"
    "\"The road washed out past the chapel,\" the girl replied, shaking rain from her coat.\n"
    "\"Then you walked the cliff path. In this weather.\"\n"
    "\"It was the only way.\"\n"
    "He moved a knight, considered it, and moved it back. \"Sit down. The kettle's hot.\"",

    "Quarterly results exceeded expectations. Revenue rose eleven percent year on year, driven "
    "by subscription renewals in the education segment, while operating costs grew more slowly "
    "thanks to lower cloud spending. Management raised its full-year guidance but cautioned "
    "that currency movements could weigh on the fourth quarter.",

    "#!/usr/bin/env bash\n"
    "set -euo pipefail\n"
    "backup_dir=\"/var/backups/$(date +%Y-%m-%d)\"\n"
    "mkdir -p \"$backup_dir\"\n"
    "for db in inventory billing users; do\n"
    "  pg_dump --format=custom \"$db\" > \"$backup_dir/$db.dump\"\n"
    "done\n"
    "find /var/backups -maxdepth 1 -type d -mtime +14 -exec rm -rf {} +",

    "Octopuses are remarkable problem solvers. In laboratory studies they have learned to open "
    "screw-top jars, navigate simple mazes and recognise individual keepers, sometimes "
    "squirting water at the ones they dislike. Most of their neurons sit not in the central "
    "brain but in the arms, which can taste and grasp with a degree of independence.",

    "Student: Why does the moon look bigger near the horizon?\n"
    "Teacher: Good question. If you measure it with a ruler held at arm's length, it's "
    "actually the same size.\n"
    "Student: So it's an illusion?\n"
    "Teacher: Exactly. Your brain compares the moon with trees and rooftops nearby, and that "
    "comparison makes it seem huge. High in the empty sky, there's nothing to compare it with.",

    "The trail leaves the car park beside a wooden gate and climbs gently through beech woods "
    "for the first two kilometres. After the stream crossing it steepens sharply; take the left "
    "fork at the stone marker and follow the yellow blazes along the ridge. On clear days the "
    "summit cairn offers views of three counties and, to the west, a thin silver line of sea.",

    "struct RingBuffer<T> {\n"
    "    items: Vec<Option<T>>,\n"
    "    head: usize,\n"
    "    len: usize,\n"
    "}\n\n"
    "impl<T> RingBuffer<T> {\n"
    "    fn push(&mut self, value: T) {\n"
    "        let tail = (self.head + self.len) % self.items.len();\n"
    "        self.items[tail] = Some(value);\n"
    "        if self.len < self.items.len() { self.len += 1; } else { self.head += 1; }\n"
    "    }\n"
    "}",

    "Before signing a lease, read the clauses on repairs and deposits carefully. Ask who is "
    "responsible for the boiler, whether the landlord needs notice before visiting, and how "
    "the deposit will be protected. Photograph every room on the day you move in, including "
    "marks on walls and the state of the carpets, and email the pictures to yourself so the "
    "date is recorded.",

    "The orchestra tuned to a single oboe note, and the hall fell quiet. The conductor raised "
    "her baton, held it for a breath, and the cellos began the slow theme that would return, "
    "transformed, in the final movement. Somewhere in the balcony a child whispered a question "
    "and was gently hushed.",

    "Error budgets make reliability a shared decision. If a service promises 99.9 percent "
    "availability over thirty days, it may be down for about forty-three minutes in that "
    "window. While budget remains, the team ships features freely; once it is spent, releases "
    "pause and engineering time moves to fixing whatever burned the budget.",

    "User: Can you suggest a name for my new coffee shop? It's small, near the train station, "
    "and we bake our own pastries.\n"
    "Assistant: Here are a few ideas: Platform Nine Bakery, The Early Train, Crumb & Carriage, "
    "or Last Stop Coffee. If you'd like something warmer and more personal, you could name it "
    "after the street or after someone in your family.",

    "Volcanic islands are born in fire and worn down by water. Lava builds a cone above the "
    "waves; rain, wind and surf then carve valleys, cliffs and beaches. Over millions of years, "
    "as the sea floor cools and sinks, the island subsides until only a ring of coral remains "
    "around a shallow lagoon, marking where a mountain once stood.",
)

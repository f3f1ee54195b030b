"""Generate a customers-style CSV like the Ray Data LLM example's (same columns), reproducibly.

    python bench/generate_customers.py ROWS OUT.csv [--repeat-share 0.3] [--seed 0]

Company names are built from word lists so they look like real ones; `--repeat-share` is the
share of rows whose company name repeats an earlier row's exactly (customer files repeat companies).
"""

from __future__ import annotations

import argparse
import csv
import random

FIRST = [
    "Hartley",
    "Boone",
    "Acme",
    "Global",
    "Nguyen",
    "Patel",
    "Ortiz",
    "Reyes",
    "Moreno",
    "Keystone",
    "Harbor",
    "Bright",
    "Kitsune",
    "Summit",
    "Pine",
    "River",
    "Oak",
    "Stone",
    "North",
    "Vega",
    "Lumen",
    "Cedar",
    "Atlas",
    "Nimbus",
    "Quartz",
    "Sierra",
    "Falcon",
    "Granite",
    "Willow",
    "Beacon",
]
SECOND = ["Hill", "Bay", "Point", "Ridge", "Field", "Gate", "Works", "Labs", "Street", "Valley", "Park", "Crest"]
KIND = [
    "LLP",
    "Inc.",
    "Group",
    "and Sons",
    "Health",
    "Medical Center",
    "Software",
    "Systems",
    "Retail",
    "Outfitters",
    "Consulting",
    "Advisory Partners",
    "Manufacturing",
    "Industries",
    "Bank",
    "Capital",
    "Realty",
    "Properties",
    "Legal",
    "Clinic",
]
CITIES = ["Paris", "Austin", "Osaka", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Perth", "Turin"]
HEADER = [
    "Index",
    "Customer Id",
    "First Name",
    "Last Name",
    "Company",
    "City",
    "Country",
    "Phone 1",
    "Phone 2",
    "Email",
    "Subscription Date",
    "Website",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", type=int)
    parser.add_argument("out")
    parser.add_argument("--repeat-share", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen: list[str] = []
    with open(args.out, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        for index in range(args.rows):
            if seen and rng.random() < args.repeat_share:
                company = rng.choice(seen)
            else:
                # The index makes every fresh name distinct, so repeats are exactly the share asked for.
                company = f"{rng.choice(FIRST)} {rng.choice(SECOND)} {rng.choice(KIND)} {index}"
                seen.append(company)
            writer.writerow(
                [
                    index + 1,
                    f"{rng.getrandbits(60):015x}",
                    "Ann",
                    "Lee",
                    company,
                    rng.choice(CITIES),
                    "France",
                    "+1-555-0100",
                    "555.0101",
                    "ann.lee@example.com",
                    "2021-05-14",
                    "https://www.example.com",
                ]
            )


if __name__ == "__main__":
    main()

"""Generate company names labelled with one of the industry task's nine industries, reproducibly.

    python bench/generate_industries.py ROWS OUT.csv [--seed 1] [--no-cue-share 0.1] [--exclude FILE.csv]

Columns `Company` and `Industry` (the gold label). Most names carry a cue to their industry, in one of
several word lists per industry and several shapes ("Hartwell Dental Clinic", "Orbit Analytics",
"Vance & Ruiz Attorneys"); `--no-cue-share` of them carry none ("Halvorsen & Pike", "Meridian Group
Holdings"): their label is drawn at random, so only a teacher that knows the company gets them right.
Names are distinct. `--exclude` leaves out every name of another file of this shape (the benchmark's
rows stay apart from the shipped sample's).
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

CUES = {
    "Law Firm": ["Law", "Legal", "Attorneys", "LLP", "Law Offices", "Counsel", "Advocates", "Law Group", "Solicitors"],
    "Healthcare": ["Clinic", "Hospital", "Medical Center", "Health", "Pharmacy", "Dental", "Care Home", "Pediatrics"],
    "Technology": ["Software", "Labs", "Analytics", "Cloud", "AI", "Systems", "Data", "Networks", "Robotics", "Apps"],
    "Retail": ["Store", "Market", "Boutique", "Outlet", "Shop", "Emporium", "Grocers", "Mart", "Fashion"],
    "Consulting": ["Consulting", "Advisors", "Advisory", "Partners Consulting", "Strategy", "Consultants"],
    "Manufacturing": ["Manufacturing", "Industries", "Fabrication", "Works", "Steel", "Machining", "Plastics", "Mills"],
    "Finance": ["Bank", "Capital", "Financial", "Credit Union", "Investments", "Insurance", "Asset Management"],
    "Real Estate": ["Realty", "Properties", "Real Estate", "Homes", "Estates", "Property Management", "Land Co."],
    "Other": ["Foundation", "Society", "Association", "Club", "Church", "Museum", "Theatre", "Charity"],
}
SURNAMES = [
    "Hartwell",
    "Vance",
    "Ruiz",
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Brennan",
    "Castillo",
    "Novak",
    "Adeyemi",
    "Sorensen",
    "Whitaker",
    "Delgado",
    "Kowalski",
    "Fairbanks",
    "Ashby",
    "Mendel",
    "Quinlan",
    "Halvorsen",
    "Pike",
    "Oduya",
    "Marchetti",
    "Sandoval",
    "Thorne",
    "Abernathy",
    "Lockwood",
    "Nakamura",
    "Fischer",
    "Calloway",
    "Ibarra",
    "Holloway",
    "Petrov",
    "Grayson",
    "Duarte",
    "Kessler",
    "Winslow",
    "Achebe",
    "Rourke",
    "Valdez",
]
WORDS = [
    "Orbit",
    "Meridian",
    "Cobalt",
    "Juniper",
    "Harbor",
    "Summit",
    "Beacon",
    "Granite",
    "Willow",
    "Falcon",
    "Crescent",
    "Aurora",
    "Pinnacle",
    "Evergreen",
    "Sterling",
    "Northwind",
    "Redwood",
    "Silverline",
    "Bluewater",
    "Keystone",
    "Ironbridge",
    "Lakeside",
    "Highland",
    "Riverstone",
    "Oakmont",
    "Clearview",
    "Brightwater",
    "Maple",
    "Horizon",
    "Vantage",
    "Crimson",
    "Atlas",
    "Trident",
    "Solstice",
    "Halcyon",
    "Everest",
    "Cascade",
    "Sapphire",
]
PLACES = [
    "Boston",
    "Denver",
    "Austin",
    "Leeds",
    "Lyon",
    "Porto",
    "Osaka",
    "Dublin",
    "Tucson",
    "Perth",
    "Oslo",
    "Quebec",
    "Cork",
    "Bristol",
    "Hamburg",
]
NO_CUE_SUFFIXES = ["Group", "Holdings", "& Co.", "Inc.", "Ltd", "Partners", "Company", "Enterprises", ""]


def cued_name(rng: random.Random, cue: str) -> str:
    shape = rng.randrange(5)
    if shape == 0:
        return f"{rng.choice(SURNAMES)} {cue}"
    if shape == 1:
        return f"{rng.choice(SURNAMES)} & {rng.choice(SURNAMES)} {cue}"
    if shape == 2:
        return f"{rng.choice(WORDS)} {cue}"
    if shape == 3:
        return f"{rng.choice(PLACES)} {rng.choice(WORDS)} {cue}"
    return f"{rng.choice(WORDS)} {rng.choice(SURNAMES)} {cue}"


def no_cue_name(rng: random.Random) -> str:
    shape = rng.randrange(3)
    suffix = rng.choice(NO_CUE_SUFFIXES)
    if shape == 0:
        return f"{rng.choice(SURNAMES)} & {rng.choice(SURNAMES)} {suffix}".strip()
    if shape == 1:
        return f"{rng.choice(WORDS)} {rng.choice(WORDS)} {suffix}".strip()
    return f"{rng.choice(PLACES)} {rng.choice(SURNAMES)} {suffix}".strip()


def generate(rows: int, seed: int, no_cue_share: float, exclude: set[str] | None = None) -> list[dict[str, str]]:
    """`rows` distinct (Company, Industry) rows; `no_cue_share` of them with no cue in the name."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    industries = list(CUES)
    out: list[dict[str, str]] = []
    tries = 0
    while len(out) < rows:
        tries += 1
        if tries > rows * 50:
            raise SystemExit(f"cannot make {rows} distinct names from the word lists (made {len(out)})")
        industry = rng.choice(industries)
        name = no_cue_name(rng) if rng.random() < no_cue_share else cued_name(rng, rng.choice(CUES[industry]))
        if name in seen:
            continue
        seen.add(name)
        out.append({"Company": name, "Industry": industry})
    return out


def write_csv(rows: list[dict[str, str]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["Company", "Industry"])
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-cue-share", type=float, default=0.1)
    parser.add_argument("--exclude", type=Path, action="append", default=[])
    args = parser.parse_args()
    exclude = {row["Company"] for path in args.exclude for row in csv.DictReader(path.open())}
    write_csv(generate(args.rows, args.seed, args.no_cue_share, exclude), args.out)


if __name__ == "__main__":
    main()

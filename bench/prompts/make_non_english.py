"""Writes bench/prompts/non-english.jsonl: the unseen traffic of bench/traffic_loop.py.

Five question templates x twelve everyday subjects x five languages (French, Spanish, Italian, Portuguese,
German) = 300 chat prompts, in the order subject, template, language, so any window of requests mixes languages
and templates. Templated, as a deployment's traffic often is (one application, one kind of question); Latin-script
languages because a warm-started retraining keeps the champion's draft vocabulary, which covers their tokens
better than Cyrillic or CJK ones (the shipped SmolLM2 draft's 8 192 rows held 6-16 % of Russian and 34-44 % of
Japanese answer tokens, 55-88 % of these languages').

    python bench/prompts/make_non_english.py
"""

import json
from pathlib import Path

LANGUAGES = {
    "fr": (["Explique-moi simplement ce qu'est {}.", "Parle-moi de l'histoire de ce sujet en quelques phrases : {}.",
            "Donne-moi trois faits intéressants sur {}.", "Quelle place occupe {} dans la vie quotidienne ?",
            "Écris un court paragraphe sur {}."],
           ["le soleil", "la pluie", "le pain", "le vélo", "le café", "la musique", "le train", "la forêt",
            "le chocolat", "le football", "la lune", "le fromage"]),
    "es": (["Explícame de forma sencilla qué es {}.", "Háblame de la historia de este tema en pocas frases: {}.",
            "Dame tres datos interesantes sobre {}.", "¿Por qué es importante {} en la vida diaria?",
            "Escribe un párrafo corto sobre {}."],
           ["el sol", "la lluvia", "el pan", "la bicicleta", "el café", "la música", "el tren", "el bosque",
            "el chocolate", "el fútbol", "la luna", "el queso"]),
    "it": (["Spiegami in modo semplice che cos'è {}.", "Parlami della storia di questo argomento in poche frasi: {}.",
            "Dammi tre fatti interessanti su {}.", "Perché è importante {} nella vita di tutti i giorni?",
            "Scrivi un breve paragrafo su {}."],
           ["il sole", "la pioggia", "il pane", "la bicicletta", "il caffè", "la musica", "il treno", "il bosco",
            "il cioccolato", "il calcio", "la luna", "il formaggio"]),
    "pt": (["Explique de forma simples o que é {}.", "Fale-me sobre a história deste tema em poucas frases: {}.",
            "Dê-me três fatos interessantes sobre {}.", "Por que {} é importante no dia a dia?",
            "Escreva um pequeno parágrafo sobre {}."],
           ["o sol", "a chuva", "o pão", "a bicicleta", "o café", "a música", "o trem", "a floresta", "o chocolate",
            "o futebol", "a lua", "o queijo"]),
    "de": (["Erkläre mir einfach, was {} ist.", "Erzähl mir in wenigen Sätzen die Geschichte dieses Themas: {}.",
            "Nenne mir drei interessante Fakten über {}.", "Warum ist {} im Alltag wichtig?",
            "Schreibe einen kurzen Absatz über {}."],
           ["die Sonne", "der Regen", "das Brot", "das Fahrrad", "der Kaffee", "die Musik", "der Zug", "der Wald",
            "die Schokolade", "der Fußball", "der Mond", "der Käse"]),
}


def main() -> None:
    rows = [{"prompt": templates[t].format(subjects[s])}
            for s in range(12) for t in range(5) for templates, subjects in LANGUAGES.values()]
    path = Path(__file__).with_name("non-english.jsonl")
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {path}")


if __name__ == "__main__":
    main()

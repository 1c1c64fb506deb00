"""Writes train.jsonl and eval.jsonl of support_chats (see README.md): conversations between
customers and the support assistant of Brightline, a made-up shop, drawn from hand-written
scenarios whose wording, details and follow-up turns vary. Deterministic:

    python configs/data/support_chats/make_chats.py
"""

import json
import random
from pathlib import Path

TRAIN, EVAL = 300, 40
HERE = Path(__file__).resolve().parent

SYSTEMS = [
    "You are Brightline's customer support assistant. Be friendly, concise and concrete.",
    (
        "You help customers of Brightline, an online shop for electronics and home goods. "
        "Answer in a few sentences and give clear next steps."
    ),
    (
        "You are a support agent for the Brightline store and app. Never ask for full card "
        "numbers or passwords. Keep answers short."
    ),
    (
        "Act as Brightline's help desk. Be polite, explain what the customer can do themselves, "
        "and say when a human colleague needs to take over."
    ),
]
PRODUCTS = [
    "wireless earbuds",
    "27-inch monitor",
    "Brightline Hub",
    "mechanical keyboard",
    "robot vacuum",
    "electric kettle",
    "pack of smart plugs",
    "laptop stand",
    "noise-cancelling headphones",
    "fitness tracker",
    "USB-C charger",
    "desk lamp",
    "coffee grinder",
    "webcam",
    "portable speaker",
    "air purifier",
]
PHONES = ["iPhone 13", "iPhone 15", "Pixel 7", "Galaxy S22", "Galaxy A54", "OnePlus 11", "iPad"]
CARRIERS = ["UPS", "DHL", "FedEx", "the postal service"]
NAMES = ["Sam", "Priya", "Tom", "Lucia", "Ahmed", "Mei", "Jonas", "Chloe", "Diego", "Hana"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


def order(r: random.Random) -> str:
    return f"BL-{r.randint(100000, 999999)}"


def price(r: random.Random) -> str:
    return f"${r.randint(12, 320)}.{r.choice(['00', '49', '99', '95'])}"


def pick(r: random.Random, options: list) -> str:
    return r.choice(options)


def a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


# Each scenario returns the turns after the optional system message: user and assistant
# alternating, the user first. Some add a follow-up exchange.


def track_order(r):
    o, item, days, carrier = order(r), pick(r, PRODUCTS), r.randint(3, 9), pick(r, CARRIERS)
    ask = pick(
        r,
        [
            f"Hi, where is my order {o}? I ordered the {item} {days} days ago.",
            f"Can you tell me the status of order {o}?",
            f"My {item} still hasn't arrived. Order number {o}.",
            f"hello, any update on {o}? it's been {days} days",
        ],
    )
    answer = pick(
        r,
        [
            (
                f"Thanks for the order number. Order {o} left our warehouse and is with {carrier}; "
                "the tracking link is in your shipping confirmation email. Parcels usually arrive "
                "within 2 to 5 working days of dispatch."
            ),
            (
                f"I've looked up {o}: it was handed to {carrier} and is on its way. You can follow "
                "it with the tracking link in your confirmation email or under Orders in your "
                "account. If it hasn't moved in 3 working days, write back and we'll open an "
                "inquiry with the carrier."
            ),
        ],
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "The tracking page hasn't changed since yesterday. Is that normal?",
            (
                "Yes, that's common: carriers often scan a parcel only when it reaches a new "
                "depot, so it can look stuck for a day or two. If there is still no change after "
                "3 working days, reply here and we'll chase it for you."
            ),
        ]
    return turns


def delivered_not_received(r):
    o, carrier = order(r), pick(r, CARRIERS)
    ask = pick(
        r,
        [
            f"The tracking for {o} says delivered but there's nothing here.",
            f"{carrier} marked my parcel as delivered yesterday, but I never got it. Order {o}.",
            f"My order {o} shows as delivered, but it isn't at my door or with my neighbours.",
        ],
    )
    answer = (
        "I'm sorry about that. Please check around your building, with neighbours and in any "
        "safe place the driver may have used, since parcels sometimes turn up within a day. "
        f"If it's still missing after 24 hours, reply here and we'll open a trace with {carrier}"
        f" for {o}. If they can't find it, we'll send a replacement or refund you in full."
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        turns += [
            "How long does a trace take?",
            (
                "Usually 3 to 5 working days. We'll email you as soon as the carrier answers, and "
                "you won't have to pay twice whatever the result."
            ),
        ]
    return turns


def damaged_item(r):
    item = pick(r, PRODUCTS)
    ask = pick(
        r,
        [
            f"My {item} arrived with a cracked case. What can I do?",
            f"The box was crushed and the {item} inside is broken.",
            f"I just unpacked the {item} and it's damaged. I want a replacement.",
        ],
    )
    answer = pick(
        r,
        [
            (
                "Sorry it arrived like that. Please send us two or three photos of the damage and "
                "of the box, together with your order number. Once we have them, we'll ship a "
                "replacement straight away; you don't need to return the damaged one first."
            ),
            (
                f"I'm sorry your {item} was damaged in transit. Reply with your order number and a "
                "photo of the damage, and tell me whether you'd prefer a replacement or a refund. "
                "Either way, shipping is on us."
            ),
        ],
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        choice = pick(r, ["a replacement", "a refund"])
        followup = (
            "A replacement usually ships within 1 working day of receiving the photos."
            if choice == "a replacement"
            else "Refunds go back to the original payment method within 5 to 10 working days."
        )
        turns += [
            f"I'd like {choice}, please. I'll send the photos now.",
            f"Perfect, I've noted that you'd like {choice}. {followup}",
        ]
    return turns


def return_item(r):
    item, days = pick(r, PRODUCTS), r.choice([14, 30])
    ask = pick(
        r,
        [
            f"How do I return the {item}? It's not what I expected.",
            f"I want to send back {a(item)} I bought last week.",
            f"Can I still return the {item}? I haven't opened it.",
        ],
    )
    answer = (
        f"You can return most items within {days} days of delivery. Go to Orders in your "
        "account, choose the order and select Return item; you'll get a prepaid label to print "
        "or a QR code to show at a drop-off point. Pack the item in its original box if you "
        "still have it."
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "When do I get my money back?",
            (
                "As soon as the return reaches our warehouse and is checked, usually within 3 "
                "working days, we refund the original payment method. Your bank may take a few "
                "more days to show it."
            ),
        ]
    return turns


def refund_timing(r):
    amount, day = price(r), pick(r, WEEKDAYS)
    ask = pick(
        r,
        [
            f"I returned an order last week and still haven't got my refund of {amount}.",
            f"When will the refund of {amount} show up on my card?",
            f"You confirmed my return on {day} but there's no refund yet.",
        ],
    )
    method = pick(r, ["card", "PayPal", "bank transfer"])
    days = {"card": "5 to 10", "PayPal": "2 to 3", "bank transfer": "3 to 5"}[method]
    answer = (
        f"Refunds are issued as soon as a return is checked in. For {method} payments it "
        f"usually takes {days} working days to appear. If it's been longer than that, send me "
        "the order number and I'll check whether the refund has gone out."
    )
    return [ask, answer]


def double_charge(r):
    amount = price(r)
    ask = pick(
        r,
        [
            f"I was charged twice for the same order, {amount} each time!",
            f"My bank shows two payments of {amount} to Brightline but I only ordered once.",
        ],
    )
    answer = (
        "I understand the worry. Often one of the two is a temporary authorisation from a "
        "payment that didn't go through, and it disappears by itself within 3 to 5 working days. "
        "If both are still there after that, reply with your order number and the dates of the "
        "charges, and we'll refund the duplicate."
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        turns += [
            "Both of them say completed, not pending.",
            (
                "Thanks for checking. In that case please send the order number and the last four "
                "digits of the card (never the full number). I'll pass it to our billing team, who "
                "refund duplicate charges within 2 working days."
            ),
        ]
    return turns


def change_address(r):
    o = order(r)
    ask = pick(
        r,
        [
            f"I put the wrong address on order {o}. Can I change it?",
            f"Can you send order {o} to my work address instead?",
            "I'm moving next week, can I change the delivery address of my order?",
        ],
    )
    answer = (
        "If the order hasn't been dispatched yet, you can change the address yourself under "
        "Orders, then Edit delivery. Once it has shipped, we can no longer change it, but the "
        "tracking page usually lets you redirect the parcel or pick it up at a nearby point."
    )
    return [ask, answer]


def cancel_order(r):
    o = order(r)
    ask = pick(
        r,
        [
            f"Please cancel order {o}, I ordered by mistake.",
            f"Is it too late to cancel {o}?",
            "How do I cancel an order I placed an hour ago?",
        ],
    )
    answer = (
        "Orders can be cancelled until they are packed, which is usually a few hours after you "
        "order. Open Orders in your account and choose Cancel order. If that button is missing, "
        "the parcel is already on its way: refuse it at the door or return it for free once it "
        "arrives."
    )
    turns = [ask, answer]
    if r.random() < 0.3:
        turns += [
            "The button is gone. Will I be charged for the return?",
            (
                "No. Returns of cancelled orders are free: use the prepaid label from the Return "
                "item page, and we refund you once the parcel is back with us."
            ),
        ]
    return turns


def password_reset(r):
    ask = pick(
        r,
        [
            "I asked for a password reset three times and no email has come.",
            "The reset password link never arrives.",
            "I can't log in and the password reset email isn't in my inbox.",
        ],
    )
    answer = (
        "Sorry for the trouble. Please check your spam or junk folder, and make sure you're "
        "using the email address your account was created with. Reset links expire after 30 "
        "minutes, so use the newest one. If nothing arrives within 10 minutes, tell me the "
        "email address and I'll check that it matches an account."
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "Found it in spam, thanks. Do I need to do anything so it doesn't happen again?",
            (
                "Great! Adding support@brightline.example to your contacts usually keeps our "
                "emails out of the spam folder."
            ),
        ]
    return turns


def lost_2fa(r):
    phone = pick(r, PHONES)
    ask = pick(
        r,
        [
            f"I got a new {phone} and now I can't get my two-factor codes.",
            "I lost my phone and can't log in because of 2FA.",
            "My authenticator app was wiped. How do I get back into my account?",
        ],
    )
    answer = (
        "You can sign in with one of the backup codes you saved when you turned on two-factor "
        "authentication, then set up the authenticator again under Security. If you don't have "
        "the backup codes, choose Can't use my code on the login page: we'll verify your identity "
        "by email, which takes up to 24 hours, and then switch 2FA off so you can set it up again."
    )
    return [ask, answer]


def change_email(r):
    name = pick(r, NAMES)
    ask = pick(
        r,
        [
            "How do I change the email address on my account?",
            f"Hi, it's {name}. I no longer use my old email, can you update it?",
        ],
    )
    answer = (
        "You can change it yourself under Account, then Profile, then Email. We'll send a "
        "confirmation link to the new address, and the change takes effect once you click it. "
        "For your security I can't change it from this chat."
    )
    return [ask, answer]


def delete_account(r):
    ask = pick(
        r,
        [
            "Please delete my account and all my data.",
            "How can I close my Brightline account?",
            "I want you to remove my personal information.",
        ],
    )
    answer = (
        "You can delete your account under Account, then Privacy, then Delete account. Your "
        "personal data is erased within 30 days; we only keep invoices for as long as tax law "
        "requires. Any open orders or returns need to be finished first."
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "Will my warranty still be valid after I delete it?",
            (
                "Yes. Keep the invoice we emailed you: the warranty follows the product, not the "
                "account, and the invoice is enough to make a claim."
            ),
        ]
    return turns


def app_crash(r):
    phone, version = pick(r, PHONES), f"4.{r.randint(1, 9)}.{r.randint(0, 5)}"
    ask = pick(
        r,
        [
            f"The Brightline app crashes as soon as I open it on my {phone}.",
            f"Since updating to version {version} the app closes immediately.",
            f"App keeps crashing on {phone}, I can't see my orders.",
        ],
    )
    answer = (
        "Sorry about that. Please try these steps in order: make sure the app and your phone's "
        "system are fully updated, restart the phone, and if it still crashes, uninstall and "
        "reinstall the app (your orders are saved in your account, not on the phone). If none "
        "of that helps, tell me your app version and I'll report it to our developers."
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        turns += [
            f"Reinstalling didn't help. It's version {version}.",
            (
                f"Thanks, that helps. I've reported the crash on {phone} with version {version} to "
                "our app team. Meanwhile you can use the website, which shows the same orders and "
                "tracking."
            ),
        ]
    return turns


def hub_wifi(r):
    ask = pick(
        r,
        [
            "My Brightline Hub won't connect to the Wi-Fi.",
            "Setup of the smart plugs fails at the 'connecting to network' step.",
            "The Hub's light keeps blinking orange and it never joins my network.",
        ],
    )
    answer = (
        "The Hub and the smart plugs only work on 2.4 GHz Wi-Fi. If your router combines 2.4 "
        "and 5 GHz under one name, turn on a separate 2.4 GHz network or pair while standing "
        "close to the router. A blinking orange light means it's waiting for setup: hold the "
        "button for 10 seconds to reset it, then start pairing again in the app."
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "I don't know how to split the networks on my router.",
            (
                "That setting is usually called 'band steering' or 'smart connect' in the router's "
                "admin page. If you tell me the router's brand and model, I can point you to the "
                "right menu."
            ),
        ]
    return turns


def discount_code(r):
    code = r.choice(["SPRING15", "WELCOME10", "BRIGHT20", "FREESHIP", "STUDENT12"])
    ask = pick(
        r,
        [
            f"The code {code} says it's invalid.",
            f"Why doesn't my discount code {code} work at checkout?",
        ],
    )
    answer = (
        "Codes can fail for a few reasons: they may have expired, apply only to some products "
        "or need a minimum order value, and only one code can be used per order. Check the "
        f"conditions in the email that gave you {code}. If they all look met, tell me what's in "
        "your basket and I'll check the code for you."
    )
    return [ask, answer]


def subscription(r):
    plan = pick(r, ["Plus", "Premium", "Family"])
    ask = pick(
        r,
        [
            f"How do I cancel my Brightline {plan} subscription?",
            f"I want to downgrade from {plan} to the free plan.",
            f"Can I pause my {plan} membership for a couple of months?",
        ],
    )
    answer = (
        f"You can change or cancel {plan} under Account, then Subscription. The change applies "
        "at the end of the current billing period, so you keep the benefits until then and "
        "won't be charged again. Pausing isn't available, but you can rejoin at any time."
    )
    return [ask, answer]


def invoice(r):
    o = order(r)
    ask = pick(
        r,
        [
            f"I need an invoice with VAT for order {o} for my company.",
            f"Can I get a receipt for {o}? My employer needs it.",
        ],
    )
    answer = (
        f"You can download the invoice for {o} as a PDF from Orders, then Invoice. To add a "
        "company name and VAT number, enter them under Account, then Billing details, before "
        "downloading; the invoice is regenerated with them."
    )
    return [ask, answer]


def payment_declined(r):
    ask = pick(
        r,
        [
            "My card keeps getting declined at checkout.",
            "Payment failed three times, but my card works everywhere else.",
        ],
    )
    answer = (
        "Sorry about that. Please check that the billing address matches the one your bank "
        "has, and approve the payment in your banking app if it asks for confirmation. Some "
        "banks block a first purchase from a new shop, so a quick call to them often solves it. "
        "You can also pay with PayPal or Apple Pay instead."
    )
    return [ask, answer]


def exchange_size(r):
    item = pick(r, ["laptop stand", "phone case", "fitness tracker strap", "headphone cushions"])
    ask = pick(
        r,
        [
            f"The {item} doesn't fit. Can I swap it for another size?",
            f"I ordered the wrong size {item}, can I exchange it?",
        ],
    )
    answer = (
        "Of course. The quickest way is to start a return under Orders and place a new order "
        "for the size you need, so it ships straight away; your refund for the first one follows "
        "once the return arrives."
    )
    return [ask, answer]


def battery(r):
    item = pick(r, ["wireless earbuds", "fitness tracker", "portable speaker", "robot vacuum"])
    ask = pick(
        r,
        [
            f"My {item} won't charge any more.",
            f"The battery of my {item} is empty after a couple of hours.",
        ],
    )
    answer = (
        "Let's try a few things first: clean the charging contacts gently with a dry cloth, use "
        "the original cable with a different plug, and leave it charging for 30 minutes before "
        "switching it on. A full reset in the app can also fix battery readings. If it still "
        "doesn't hold a charge, it's covered by the two-year warranty and we'll replace it."
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        turns += [
            "Tried all of that, still the same.",
            (
                "Thanks for trying. Please send me your order number and I'll start a warranty "
                "replacement. You'll get a prepaid label to send the faulty one back."
            ),
        ]
    return turns


def warranty(r):
    item, months = pick(r, PRODUCTS), r.randint(7, 22)
    ask = pick(
        r,
        [
            f"My {item} stopped working after {months} months. Is it under warranty?",
            f"Is the {item} covered if it broke after {months} months of normal use?",
        ],
    )
    answer = (
        f"Yes, everything we sell has a two-year warranty, so {a(item)} that failed after "
        f"{months} months is covered for faults that aren't caused by accidents or water. "
        "Start a claim under Orders, then Warranty claim, and describe the problem; we'll "
        "repair or replace it at no cost."
    )
    return [ask, answer]


def restock(r):
    item = pick(r, PRODUCTS)
    ask = pick(
        r,
        [
            f"When will the {item} be back in stock?",
            f"The {item} has been sold out for weeks. Are you getting more?",
        ],
    )
    answer = (
        f"I don't have an exact date for the {item}, but new stock usually arrives every 2 to 4 "
        "weeks. Press Notify me on the product page and we'll email you the moment it's "
        "available again."
    )
    return [ask, answer]


def late_delivery(r):
    o, days = order(r), r.randint(4, 10)
    ask = pick(
        r,
        [
            f"Order {o} was promised for last week and it's now {days} days late.",
            f"I paid for express shipping on {o} and it still hasn't come.",
        ],
    )
    answer = (
        f"I'm sorry that {o} is late. I've asked the carrier for an update and will email you "
        "as soon as we hear back. If you paid for express shipping and it didn't arrive on time, "
        "we refund the shipping cost automatically once it's delivered."
    )
    turns = [ask, answer]
    if r.random() < 0.4:
        turns += [
            "And if it never arrives?",
            (
                "Then we'll send a new one or refund the whole order, whichever you prefer. You "
                "won't be left out of pocket."
            ),
        ]
    return turns


def customs(r):
    country = pick(r, ["Switzerland", "Norway", "the UK", "Canada"])
    ask = pick(
        r,
        [
            f"Do I have to pay customs fees if I order to {country}?",
            f"The courier wants import tax before delivering my parcel in {country}. Why?",
        ],
    )
    answer = (
        f"For deliveries to {country}, prices on our site don't include import duties or local "
        "taxes, which the carrier collects on delivery. The checkout shows an estimate before "
        "you pay. If you refuse the parcel, we refund the items but not the original shipping."
    )
    return [ask, answer]


def checkout_error(r):
    code = r.choice(["E-401", "E-503", "PAY-12", "CHK-7"])
    ask = pick(
        r,
        [
            f"I get error {code} when I try to check out.",
            f"The website shows '{code}' and won't let me pay.",
        ],
    )
    answer = (
        f"Thanks for the code. {code} usually means the session expired: refresh the page, "
        "sign in again and try once more. Clearing your browser's cookies for our site or "
        "using another browser also helps. Your basket is saved in your account, so nothing "
        "is lost."
    )
    turns = [ask, answer]
    if r.random() < 0.3:
        turns += [
            "It worked in another browser, thanks!",
            (
                "Glad to hear it! If the first browser keeps failing, clearing its cookies for "
                "brightline.example should fix it there too."
            ),
        ]
    return turns


def thanks_goodbye(r):
    name = pick(r, NAMES)
    ask = pick(
        r,
        [
            f"Hi, I'm {name}. Do you have a phone number I can call?",
            "Can I talk to a real person?",
            "What are your support hours?",
        ],
    )
    answer = (
        "You can reach our support team by chat here at any time, and by phone from Monday to "
        "Saturday, 8am to 8pm. If you'd rather talk to a colleague, tell me briefly what it's "
        "about and I'll ask them to call you back."
    )
    turns = [ask, answer]
    if r.random() < 0.5:
        turns += [
            "Okay, it's about a missing parcel. Please have someone call me tomorrow.",
            (
                "Done: I've asked a colleague to call you tomorrow about the missing parcel. "
                "They'll use the phone number on your account, so please check it's up to date."
            ),
        ]
    return turns


SCENARIOS = [
    track_order,
    delivered_not_received,
    damaged_item,
    return_item,
    refund_timing,
    double_charge,
    change_address,
    cancel_order,
    password_reset,
    lost_2fa,
    change_email,
    delete_account,
    app_crash,
    hub_wifi,
    discount_code,
    subscription,
    invoice,
    payment_declined,
    exchange_size,
    battery,
    warranty,
    restock,
    late_delivery,
    customs,
    checkout_error,
    thanks_goodbye,
]


def conversation(r: random.Random) -> dict:
    turns = r.choice(SCENARIOS)(r)
    roles = ["user", "assistant"] * (len(turns) // 2)
    messages = [{"role": a, "content": t} for a, t in zip(roles, turns, strict=True)]
    if r.random() < 0.4:
        messages.insert(0, {"role": "system", "content": r.choice(SYSTEMS)})
    return {"messages": messages}


def main() -> None:
    r = random.Random(2025)
    seen, rows = set(), []
    while len(rows) < TRAIN + EVAL:
        row = conversation(r)
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    for name, part in (("train", rows[:TRAIN]), ("eval", rows[TRAIN:])):
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

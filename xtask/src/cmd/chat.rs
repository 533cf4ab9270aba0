//! Chat prompts: a conversation rendered with the model's own chat template (Jinja), in the
//! environment Transformers renders them in (blocks trimmed, Python's string methods,
//! `raise_exception`), so an instruct model sees the prompt it was trained on.

use crate::Exit;
use oracle::tokenizer::Tokenizer;

/// The fuel a chat template may burn in one render ([`render`]).
pub const TEMPLATE_FUEL: u64 = 100_000;

/// The longest chat prompt a template may render, in bytes: 1 MiB holds a 128k-token context
/// of English text twice over. What the fuel allows is several times more, and tokenizing it
/// takes about 100 bytes per byte of text.
pub const MAX_RENDERED_BYTES: usize = 1 << 20;

/// `messages` as (role, content) rendered with `template`, ending with the assistant's turn
/// opened (`add_generation_prompt`); `bos_token` and `eos_token` are the tokenizer's pieces.
pub fn render(template: &str, messages: &[(&str, &str)], tok: &Tokenizer) -> Result<String, Exit> {
    let bad = |e: minijinja::Error| {
        let budget = if e.kind() == minijinja::ErrorKind::OutOfFuel { format!(" (its budget is {TEMPLATE_FUEL} steps: no chat prompt needs a loop or a string this large)") } else { String::new() };
        Exit::new(2, format!("chat template: {e:#}{budget}"))
    };
    let mut env = minijinja::Environment::new();
    // A template is part of a model file, which may come from anywhere: its loops and strings
    // run on a budget (minijinja's fuel: about one unit per instruction or 64 bytes), so a
    // nested loop or a string multiplied a billion times is an error, not a hang or an abort.
    // Real templates need far less (SmolLM2's, with two messages: under 100).
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(bad)?);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> { Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg)) });
    env.add_template("chat", template).map_err(bad)?;
    let piece = |id: Option<u32>| id.and_then(|i| tok.piece(i)).unwrap_or_default();
    let messages: Vec<serde_json::Value> = messages.iter().map(|(role, content)| serde_json::json!({ "role": role, "content": content })).collect();
    let ctx = minijinja::context! {
        messages => minijinja::value::Value::from(minijinja::value::Serde(messages)),
        add_generation_prompt => true,
        bos_token => piece(tok.bos),
        eos_token => piece(tok.eos.first().copied()),
    };
    let text = env.get_template("chat").and_then(|t| t.render(ctx)).map_err(bad)?;
    if text.len() > MAX_RENDERED_BYTES {
        return Err(Exit::new(2, format!("chat template: it rendered {} bytes, more than the {MAX_RENDERED_BYTES} a chat prompt may hold (no model's context takes that much text)", text.len())));
    }
    Ok(text)
}

/// The ids of a rendered chat prompt: the BOS a tokenizer puts first (a GGUF's `add_bos_token`,
/// a tokenizer.json's post-processor) is dropped when the template already wrote it, as
/// Transformers tokenizes a rendered chat without adding special tokens.
pub fn encode(rendered: &str, tok: &Tokenizer) -> Result<Vec<u32>, Exit> {
    let mut ids = tok.encode(rendered)?;
    if let (Some(b), [first, second, ..]) = (tok.bos, ids.as_slice()) {
        if *first == b && *second == b {
            ids.remove(0);
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hostile template (a model file's: loops of 10^10 steps, a string of 10^9 bytes,
    /// unbounded recursion) is an error in well under a second; the model's own renders.
    #[test]
    fn hostile_templates_run_out_of_fuel() {
        let tok = oracle::loader::open_tokenizer(&::fixtures::resolve("smollm2", true).unwrap()).unwrap().unwrap();
        for t in ["{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "{{ 'x' * 1000000000 }}", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"] {
            let start = std::time::Instant::now();
            let e = render(t, &[("user", "hi")], &tok).err().unwrap_or_else(|| panic!("{t}: rendered"));
            assert!(e.code == 2 && e.message.starts_with("chat template: ") && (e.message.contains(&format!("its budget is {TEMPLATE_FUEL} steps")) || e.message.contains("recursion limit")), "{t}: {}", e.message);
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "{t}: {:?}", start.elapsed());
        }
        let own = oracle::loader::chat_template(&::fixtures::resolve("smollm2", true).unwrap()).unwrap().unwrap();
        let text = render(&own, &[("system", "You are helpful."), ("user", "What is the capital of France?")], &tok).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        // The budget is far above what a real conversation takes: 1,000 turns render.
        let turns: Vec<(&str, &str)> = (0..1000).map(|i| (if i % 2 == 0 { "user" } else { "assistant" }, "Tell me more about Paris.")).collect();
        assert!(render(&own, &turns, &tok).is_ok());
    }

    /// A template that writes more than a prompt can hold is an error before anything tokenizes
    /// it (tokenizing takes about 100 bytes per byte of text); the fuel bounds what it can build.
    #[test]
    fn a_render_larger_than_any_prompt_is_refused() {
        let tok = oracle::loader::open_tokenizer(&::fixtures::resolve("smollm2", true).unwrap()).unwrap().unwrap();
        let doubling = "{% set ns = namespace(x='0123456789abcdef' * 4) %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}";
        let long = "{{ 'x' * 2000000 }}";
        for t in [doubling, long] {
            let start = std::time::Instant::now();
            let e = render(t, &[("user", "hi")], &tok).err().unwrap_or_else(|| panic!("{t}: rendered"));
            assert!(e.code == 2 && (e.message.contains("bytes, more than the") || e.message.contains("its budget is")), "{t}: {}", e.message);
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "{t}: {:?}", start.elapsed());
        }
        let e = render(long, &[("user", "hi")], &tok).err().unwrap();
        assert!(e.message.contains("rendered 2000000 bytes"), "{}", e.message);
    }

    /// A namespace that holds itself is a reference cycle minijinja never frees (found by the
    /// `chat_template` fuzz target under LeakSanitizer): what one render can leave behind is
    /// bounded by the fuel, which ends such a loop after a few thousand namespaces.
    #[test]
    fn namespace_cycles_run_out_of_fuel_early() {
        let tok = oracle::loader::open_tokenizer(&::fixtures::resolve("smollm2", true).unwrap()).unwrap().unwrap();
        let t = "{% for i in range(1000) %}{% for j in range(1000) %}{% set ns = namespace(n=j) %}{% set ns.me = ns %}{% endfor %}{% endfor %}";
        let e = render(t, &[("user", "hi")], &tok).err().expect("a million namespaces");
        assert!(e.message.contains(&format!("its budget is {TEMPLATE_FUEL} steps")), "{}", e.message);
    }

    /// A template that writes BOS itself gets it once (SmolLM2's BOS is `<|im_start|>`, id 1);
    /// a text that does not start with it is left alone.
    #[test]
    fn a_bos_the_template_wrote_is_not_doubled() {
        let tok = oracle::loader::open_tokenizer(&::fixtures::resolve("smollm2", true).unwrap()).unwrap().unwrap();
        assert_eq!(tok.bos, Some(1));
        let doubled = tok.encode("<|im_start|><|im_start|>user").unwrap();
        assert_eq!(&doubled[..2], &[1, 1]);
        assert_eq!(encode("<|im_start|><|im_start|>user", &tok).unwrap(), doubled[1..]);
        assert_eq!(encode("<|im_start|>user", &tok).unwrap(), tok.encode("<|im_start|>user").unwrap());
        assert_eq!(encode("hello", &tok).unwrap(), tok.encode("hello").unwrap());
    }
}

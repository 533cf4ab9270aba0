//! SmolLM2-135M and Gemma 3 270M against independent f64 references, their chat templates as
//! Jinja2 renders them, and Gemma 3 through layer-diff and fixed-token.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

/// The independent reference (tools/reference/llama_f64.py: gguf-py decoders + numpy f64).
/// Returns None, printing why, when Python or its packages are missing.
fn reference(model: &Path, greedy: usize) -> Option<serde_json::Value> {
    if !python_with_reference_peers() {
        return None;
    }
    let out = tempfile::NamedTempFile::new().unwrap();
    let st = Command::new("python3")
        .arg(workspace().join("tools/reference/llama_f64.py"))
        .arg(model)
        .args(["--prompt-ids", PROMPT_IDS, "--greedy", &greedy.to_string(), "--out"])
        .arg(out.path())
        .status()
        .unwrap();
    assert!(st.success(), "reference script failed");
    Some(serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap())
}

#[test]
fn smollm2_agrees_with_an_independent_f64_reference() {
    let model = smollm2();
    let Some(r) = reference(&model, 32) else { return };
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["dump", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--out", dir.path().to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, logits) = read_logits(dir.path());
    let n_vocab = shape[1];
    let last = &logits[(shape[0] - 1) * n_vocab..];
    let ref_last: Vec<f64> = r["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let max_abs = last.iter().zip(&ref_last).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    eprintln!("smollm2 last-position logits: max |oracle - f64 reference| = {max_abs:.3e}");
    assert!(max_abs <= 1e-3, "max abs {max_abs}");
    let top5 = oracle::ops::top_k(last, 5);
    let ref_top5: Vec<usize> = r["top5"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(top5, ref_top5);

    let o = xtask(&["run", "--model", "smollm2", "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "32", "--ignore-eos", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], r["greedy"], "greedy sequences differ");
}

/// `run --chat` renders the model's own chat template as Transformers does (Jinja2 with blocks
/// trimmed, `raise_exception`, loop controls): the prompt `run --chat --json` reports equals
/// Jinja2's rendering of SmolLM2's template and of a template that leans on Python string
/// methods, whitespace control, a namespace and a system message; the ids start with the chat
/// tokens, matched whole. Jinja2 comes from tools/reference/requirements.txt; without it this
/// compares nothing and says SKIPPED.
/// `src` (a GGUF) written to `out` with `template` as its chat template.
fn with_chat_template(src: &Path, template: &str, out: &Path) {
    let g = oracle::gguf::GgufFile::open(src).unwrap();
    let mut w = oracle::gguf::GgufWriter::new();
    for (k, v) in &g.metadata {
        if k != "tokenizer.chat_template" {
            w.meta(k, v.clone());
        }
    }
    w.meta("tokenizer.chat_template", oracle::gguf::Value::String(template.into()));
    for t in &g.tensors {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    w.write_to(out).unwrap();
}

/// `template` rendered by Jinja2 as Transformers renders chat templates (a sandboxed
/// environment, trimmed blocks, loop controls, `raise_exception`) for `messages`, with a
/// generation prompt.
fn jinja2_render(template: &str, messages: &[serde_json::Value], bos: &str, eos: &str) -> String {
    let input = serde_json::json!({"t": template, "m": messages, "bos": bos, "eos": eos});
    let script = "import json, sys, jinja2\nfrom jinja2.sandbox import ImmutableSandboxedEnvironment\nd = json.load(sys.stdin)\nenv = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=['jinja2.ext.loopcontrols'])\ndef raise_exception(m):\n    raise jinja2.exceptions.TemplateError(m)\nenv.globals['raise_exception'] = raise_exception\nsys.stdout.write(env.from_string(d['t']).render(messages=d['m'], add_generation_prompt=True, bos_token=d['bos'], eos_token=d['eos']))";
    let mut child = Command::new("python3").args(["-c", script]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.to_string().as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn chat_prompts_render_as_jinja2_renders_them() {
    let smol = smollm2();
    let custom = "{{- bos_token -}}{%- set ns = namespace(sys='') -%}{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.sys = m['content'].strip() -%}{%- continue -%}{%- endif -%}\n<|im_start|>{{ m['role'] }}{% if ns.sys %} [{{ ns.sys.upper() }}]{% endif %}\n  {{ m['content'].replace('France', 'FRANCE') | trim }}<|im_end|>{%- if loop.last and m['role'] != 'user' %}{{ raise_exception('last message must be the user') }}{% endif -%}\n{%- endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let dir = tempfile::tempdir().unwrap();
    // SmolLM2 with its template replaced by the custom one.
    let custom_model = dir.path().join("custom-template.gguf");
    with_chat_template(&smol, custom, &custom_model);
    let have_jinja2 = Command::new("python3").args(["-c", "import jinja2"]).output().is_ok_and(|o| o.status.success());
    for (model, system) in [(&smol, None), (&custom_model, Some("  be brief ")), (&custom_model, None)] {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "--chat", "--prompt", " What is the capital of France? ", "--max-new-tokens", "0", "--json"];
        if let Some(s) = system {
            args.extend(["--system", s]);
        }
        let o = xtask(&args, &[]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ours = v["chat_prompt"].as_str().unwrap().to_string();
        let ids = v["prompt_ids"].as_array().unwrap();
        assert!(ids.iter().filter(|i| i.as_u64() == Some(1)).count() >= 2, "<|im_start|> matched whole: {ids:?}");
        if !have_jinja2 {
            eprintln!("SKIPPED (Jinja2 part): jinja2 is not installed (pip install -r tools/reference/requirements.txt)");
            continue;
        }
        let template = oracle::loader::chat_template(model).unwrap().unwrap();
        let mut messages = vec![];
        if let Some(s) = system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": " What is the capital of France? "}));
        assert_eq!(ours, jinja2_render(&template, &messages, "<|im_start|>", "<|im_end|>"), "{}", model.display());
    }
    // A model without a chat template: exit 2 saying so.
    let o = xtask(&["run", "--model", "tiny-llama", "--chat", "--prompt", "hi", "--max-new-tokens", "0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("has no chat template"), "{}", stderr(&o));
}

/// 540 ids (BOS, then a fixed spread over Gemma 3's vocabulary): past its 512-position window,
/// so the last position's windowed layers see another set of keys than its global ones.
fn gemma3_long_ids() -> String {
    std::iter::once(2u64).chain((1..540u64).map(|i| 100 + (i * 2_654_435_761) % 200_000)).map(|v| v.to_string()).collect::<Vec<_>>().join(",")
}

/// Gemma 3 270M (Q4_K_M, real weights) against the independent f64 reference
/// (tools/reference/llama_f64.py: gguf-py's decoders, Google's published Gemma 3 maths in numpy):
/// the last position's logits of a 540-token prompt within 1e-6 of the logits' scale, the same
/// top 5 and the same 4 greedy tokens. Skips, saying so, without Python's gguf and numpy.
#[test]
fn gemma3_agrees_with_an_independent_f64_reference() {
    let model = gemma3();
    if !python_with_reference_peers() {
        return;
    }
    let ids = gemma3_long_ids();
    let out = tempfile::NamedTempFile::new().unwrap();
    let st = Command::new("python3").arg(workspace().join("tools/reference/llama_f64.py")).arg(&model).args(["--prompt-ids", &ids, "--greedy", "4", "--out"]).arg(out.path()).status().unwrap();
    assert!(st.success(), "reference script failed");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let o = xtask(&["dump", "--model", "gemma3", "--prompt-ids", &ids, "--out", dir.path().to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, logits) = read_logits(dir.path());
    let last = &logits[(shape[0] - 1) * shape[1]..];
    let want: Vec<f64> = r["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_abs = last.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    eprintln!("gemma3 position 539 logits: max |oracle - f64 reference| = {max_abs:.3e} (scale {scale:.1})");
    assert!(max_abs <= 1e-6 * scale, "max abs {max_abs}, scale {scale}");
    let ref_top5: Vec<usize> = r["top5"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(oracle::ops::top_k(last, 5), ref_top5);
    let o = xtask(&["run", "--model", "gemma3", "--prompt-ids", &ids, "--max-new-tokens", "4", "--ignore-eos", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], r["greedy"], "greedy sequences differ");
}

/// A chat template in Gemma 3's form (the instruction-tuned models' own: `<start_of_turn>` and
/// `<end_of_turn>` markers, the assistant's turns named `model`, the system prompt folded into
/// the first user turn, contents as a string or a list of typed parts, roles checked to
/// alternate): `run --chat` on Gemma 3 270M with it renders what Jinja2 renders, and the markers
/// are matched whole (ids 105 and 106).
#[test]
fn gemma3_chat_template_renders_as_jinja2_renders_it() {
    let template = concat!(
        "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n{%- if messages[0]['content'] is string -%}\n",
        "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n{%- else -%}\n",
        "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n{%- endif -%}\n",
        "{%- set loop_messages = messages[1:] -%}\n{%- else -%}\n{%- set first_user_prefix = \"\" -%}\n",
        "{%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n",
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n",
        "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n{%- endif -%}\n",
        "{%- if (message['role'] == 'assistant') -%}\n{%- set role = \"model\" -%}\n{%- else -%}\n",
        "{%- set role = message['role'] -%}\n{%- endif -%}\n",
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n",
        "{%- if message['content'] is string -%}\n{{ message['content'] | trim }}\n",
        "{%- elif message['content'] is iterable -%}\n{%- for item in message['content'] -%}\n",
        "{%- if item['type'] == 'image' -%}\n{{ '<start_of_image>' }}\n{%- elif item['type'] == 'text' -%}\n",
        "{{ item['text'] | trim }}\n{%- endif -%}\n{%- endfor -%}\n{%- else -%}\n",
        "{{ raise_exception(\"Invalid content type\") }}\n{%- endif -%}\n{{ '<end_of_turn>\n' }}\n{%- endfor -%}\n",
        "{%- if add_generation_prompt -%}\n{{'<start_of_turn>model\n'}}\n{%- endif -%}\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gemma3-chat.gguf");
    with_chat_template(&gemma3(), template, &model);
    let o = xtask(&["run", "--model", model.to_str().unwrap(), "--chat", "--system", "Answer in one word.", "--prompt", " What is the capital of France? ", "--max-new-tokens", "0", "--json"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours = v["chat_prompt"].as_str().unwrap();
    assert!(ours.starts_with("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?<end_of_turn>\n"), "{ours:?}");
    let ids: Vec<u64> = v["prompt_ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect();
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 2, "<start_of_turn> matched whole: {ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 106).count(), 1, "<end_of_turn> matched whole: {ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "one BOS (the template's, none added): {ids:?}");
    if Command::new("python3").args(["-c", "import jinja2"]).output().is_ok_and(|o| o.status.success()) {
        let messages = [serde_json::json!({"role": "system", "content": "Answer in one word."}), serde_json::json!({"role": "user", "content": " What is the capital of France? "})];
        assert_eq!(ours, jinja2_render(template, &messages, "<bos>", "<eos>"));
    } else {
        eprintln!("SKIPPED (Jinja2 part): jinja2 is not installed (pip install -r tools/reference/requirements.txt)");
    }
}

/// Gemma 3 270M passes layer-diff (both modes on `cpu` and `fixed`, propagated on `cpu:kv-f16`:
/// its cache term is the attention's alone) and fixed-token on `cpu`, each at its declared
/// arithmetic.
#[test]
fn gemma3_passes_layer_diff_and_fixed_token() {
    gemma3();
    for (device, modes) in [("cpu", &["isolated", "propagated"][..]), ("cpu:kv-f16", &["propagated"][..]), ("fixed", &["isolated", "propagated"][..])] {
        for &mode in modes {
            let dir = tempfile::tempdir().unwrap();
            let o = xtask(&["layer-diff", "--device", device, "--model", "gemma3", "--mode", mode, "--report-dir", dir.path().to_str().unwrap()], &[]);
            assert_eq!(o.status.code(), Some(0), "{device} {mode}: {}", text(&o));
            let r = report(dir.path());
            assert!(r["summary"]["passed"].as_u64().unwrap() > 300, "{device} {mode}: {}", r["summary"]);
        }
    }
    let o = xtask(&["fixed-token", "--device", "cpu", "--model", "gemma3"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

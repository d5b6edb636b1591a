"""Every piece of text the studio shows: tab names, labels, help, messages.

Kept in one place so wording stays consistent and a translation touches one file. Messages with
`{placeholders}` are filled with `str.format` by the handlers.
"""

from __future__ import annotations

TITLE = "Kestrel Studio"
SUBTITLE = "Fine-tune a language model on your own data: upload, train, watch, chat, export."

# --- tabs ------------------------------------------------------------------------------------
TAB_DATASETS, TAB_TRAIN, TAB_RUNS, TAB_CHAT, TAB_EXPORT = "Datasets", "Train", "Runs", "Chat", "Export"

# --- datasets tab ----------------------------------------------------------------------------
DS_UPLOAD = "Upload a dataset (.jsonl, .json, .csv, .parquet)"
DS_SAMPLES = "Or pick a sample dataset"
DS_USE_SAMPLE = "Use sample"
DS_REGISTERED = "Datasets you have"
DS_OPEN = "Open"
DS_FORMAT = "Format"
DS_FORMAT_INFO = "Detected from the columns; correct it if it is wrong."
DS_MAPPING = "Column for each role"
DS_APPLY_MAPPING = "Apply format and columns"
DS_PREVIEW = "First 10 rows"
DS_REPORT = "Validation report (rows that will be skipped)"
DS_HISTOGRAM = "Tokens per row"
DS_TOKEN_ROW = "Row to preview (line number)"
DS_TOKENS = "Token preview: trained tokens, masked tokens (not in the loss), and what max_seq_length cuts off"
DS_TOKEN_LABELS = {"trained": "trained", "masked": "masked", "cut": "cut off"}
DS_SUMMARY = ("**{name}** · format **{format}** · {rows} rows, {good} usable, {bad} skipped · "
              "tokens per row: mean {mean:.0f}, p95 {p95:.0f}, max {max}{note}")
DS_SUMMARY_NOFORMAT = "**{name}** · {rows} rows · columns: {columns}"
DS_HIST_NOTE = " (histogram of the first {n} rows)"
DS_TOKEN_SUMMARY = ("Line {line}: {total} tokens, {trained} trained, {masked} masked{cut}. "
                    "Tokenizer of model `{model}`.")
DS_TOKEN_CUT = ", **{cut} cut off** by max_seq_length={max_len}"
DS_MAPPING_SAVED = " · columns saved with the dataset: {mapping}"
DS_NO_DATASET = "Upload a dataset or pick a sample first."
DS_LOADED = "Loaded {name}: {good} usable rows as {format}."
DS_NO_ROW = "There is no usable row at line {line}; usable lines run from {first} to {last}."
DS_PREFERENCE_FORMATS = {"paired": "preference pairs ({layout}; for DPO, ORPO, SimPO)",
                         "unpaired": "labelled answers ({layout}; for KTO)"}
DS_KTO_LABELS = {True: "👍 desirable", False: "👎 undesirable"}
DS_PREFERENCE_TOKENS = ("Line {line}: prompt {prompt} tokens (masked: context only); answers {answers} tokens "
                        "(scored). Tokenizer of model `{model}`.")

# --- train tab -------------------------------------------------------------------------------
TR_PRESET = "Preset"
TR_APPLY_PRESET = "Apply preset"
TR_MODEL_SOURCE = "Model"
TR_MODEL_SOURCES = {"demo": "Built-in demo (offline)", "local": "Local folder", "hub": "Hugging Face hub id"}
TR_MODEL = "Folder or hub id"
TR_MODEL_INFO = "A folder holding config.json and *.safetensors, or an id like Qwen/Qwen2.5-0.5B-Instruct"
TR_MODEL_LOCAL_INFO = ("A folder holding config.json and *.safetensors; the list offers the full models your "
                       "finished runs saved (to train DPO or GRPO on top of them)")
TR_MODEL_RUN = "Run #{job}: {name} (full model)"
TR_METHOD = "Method"
TR_METHODS = {"qlora": "QLoRA (4-bit base, least memory)", "lora": "LoRA (16-bit base)",
              "full": "Full fine-tune", "grpo": "GRPO (reinforcement learning with rewards)",
              **{  # preference methods: what they train is their settings' `finetune` (LoRA, QLoRA or full)
                  "dpo": "DPO (preferences: chosen vs rejected)", "orpo": "ORPO (preferences, no reference model)",
                  "simpo": "SimPO (preferences, length-normalised, no reference)",
                  "kto": "KTO (answers labelled good or bad)"}}
TR_DATASET = "Dataset"
TR_START = "Start training"
TR_ADVANCED = "Advanced"
TR_GRPO = "GRPO settings"
TR_EVALUATION = "Evaluation (eval loss, early stopping, best weights)"
TR_EVALUATION_INFO = ("With held-out rows (a share of the dataset, or a file) the run reports `eval_loss` (GRPO: "
                      "`eval_reward`) beside the training loss in the Runs tab, keeps its best weights (Export and Chat "
                      "offer them first) and, at the end, answers a few held-out prompts for the Runs tab's "
                      "generation check.")
TR_PREFERENCE = "Preference settings (DPO, ORPO, SimPO, KTO)"
TR_PREFERENCE_INFO = (
    "**Data.** DPO, ORPO and SimPO take `prompt`, `chosen`, `rejected` (text or message lists; whole "
    "conversations as in UltraFeedback, or Anthropic HH `Human:`/`Assistant:` transcripts, need no prompt). "
    "KTO takes `prompt`, `completion` and a true/false `label`. **Beta** is DPO's and KTO's KL strength, "
    "ORPO's odds-ratio weight (its lambda) and SimPO's reward scale; the loss type applies to DPO.")
TR_YAML = "The run as YAML (the file `python -m kestrel train CONFIG.yaml` takes)"
TR_APPLY_YAML = "Use this YAML"
TR_LOAD_YAML = "Load a YAML file"
TR_DOWNLOAD_YAML = "Download YAML"
TR_VRAM = "Memory estimate"
TR_STARTED = "Started job #{job} ({name}). Follow it on the Runs tab."
TR_QUEUED = "Queued job #{job} ({name}); it starts when job #{running} frees the device."
TR_TWICE = "This run was already started as job #{job}, which is {status}. Change something to start another."
TR_YAML_APPLIED = "Form filled from the YAML."
TR_PRESET_APPLIED = "Preset “{name}” applied. Changed: {changes}."
TR_PRESET_NO_CHANGE = "nothing (the form already matched it)"
TR_PRESET_KEPT = "Kept your {what}."
VRAM_LINE = ("{verdict_icon} **{verdict}** on {gpu} ({capacity:.1f} GiB): about **{total:.1f} GiB** peak{per_gpu} "
             "(weights {weights:.1f}, optimizer {optimizer:.1f}, activations {activations:.1f}, "
             "other {other:.1f}); {trainable} trainable parameters.")
VRAM_CPU = ("No NVIDIA GPU found: training runs on the CPU, which works for the demo model and tiny "
            "models only (about {total:.1f} GiB of RAM for this run). QLoRA needs a GPU: pick one below "
            "to see whether this run would fit it.")
VRAM_PICKED = "No NVIDIA GPU here; for the card you picked: "
VRAM_PER_GPU = " per GPU, on {n} GPUs"  # a run over several GPUs: the estimate is each one's
TR_GPU = "GPU to estimate for (this machine has none)"
VRAM_UNKNOWN = "No estimate: {reason}"
# How much of the chosen model Kestrel's fast path covers (under the memory estimate).
FAMILY_TITLES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3",
                 "qwen3_5_text": "Qwen3.5", "gemma4_text": "Gemma 4", "qwen3_moe": "Qwen3-MoE", "gpt_oss": "gpt-oss",
                 "qwen3_5_moe_text": "Qwen3.5-MoE"}
PATH_FULL = "**{family}**: on Kestrel's fast path (its kernels, padding-free packing, fast decode)."
PATH_TRAINS_FAST = ("**{family}**: trains on Kestrel's fast path (its kernels, padding-free packing); chat and GRPO "
                    "rollouts decode through Hugging Face's forward.")
PATH_PARTIAL = ("**{family}**: partly on Kestrel's fast path ({levels}); its other modules run Hugging Face's "
                "code{decode}.")
PATH_HF_DECODE = ", and chat and GRPO rollouts decode through Hugging Face's forward"
PATH_NONE = ("No fast path for model type `{model_type}` yet: it trains through plain Hugging Face (slower, and "
             "more memory than estimated), and chat decodes through Hugging Face's forward.")
PATH_IMAGE_TEXT = " An image-text model: its language model trains on text, the vision tower stays frozen."
PATH_LEVELS = {"rms_norm": "norms", "attention": "attention", "linear_attention": "linear attention", "mlp": "MLP",
               "decoder_layer": "layers", "model": "packing", "causal_lm": "chunked loss"}
VRAM_HOST = ("{verdict_icon} Offloaded activations (layer inputs, MLP gate products): **{host:.1f} GiB** of host RAM "
             "(this machine has {ram:.1f} GiB): **{verdict}**.")
VRAM_HOST_NO_RAM = ("Offloaded activations (layer inputs, MLP gate products): **{host:.1f} GiB** of host RAM "
                    "(this machine's RAM is unknown).")
VRAM_AUTO = "Gradient checkpointing **auto** → **{mode}** here: {why}."
# what sets the number of tokens whose layer inputs are offloaded (GRPO: its rollouts)
VRAM_HOST_LOWER = {
    "grpo": " Lower the batch size, the number of generations or the prompt/completion lengths, "
            "or use gradient checkpointing “standard”.",
    "other": " Lower the max sequence length or the batch size, or use gradient checkpointing “standard”.",
}
VRAM_ICONS = {"fits": "✅", "tight": "⚠️", "will not fit": "⛔"}

# field labels of the train form (dotted config keys)
FIELD_LABELS = {
    "max_seq_length": "Max sequence length (tokens)", "max_steps": "Max steps (empty: use epochs)",
    "epochs": "Epochs", "learning_rate": "Learning rate", "batch_size": "Batch size",
    "grad_accum": "Gradient accumulation", "lora.r": "LoRA rank r", "lora.alpha": "LoRA alpha",
    "lora.dropout": "LoRA dropout", "lora.targets": "LoRA target modules",
    "grpo.rewards": "Rewards (one per row; the weighted sum is the reward)",
    "lora.init_from": "Start from adapter (optional: a LoRA run's folder, e.g. for GRPO after SFT)", "packing": "Packing",
    "train_on_responses_only": "Train on responses only", "gradient_checkpointing": "Gradient checkpointing",
    "save_steps": "Save every N steps (0: only at the end)", "seed": "Seed",
    "devices": "Devices (1; a count N; auto = every GPU; or GPU ids such as 0,1)", "dtype": "Compute dtype",
    "warmup_steps": "Warmup steps", "lr_scheduler": "LR schedule", "weight_decay": "Weight decay",
    "max_grad_norm": "Max grad norm (0: no clipping)", "logging_steps": "Log every N steps",
    "dataset_format": "Dataset format", "system_prompt": "System prompt (added when a row has none)",
    "fast_kernels": "Fast kernels", "name": "Run name (optional)", "output_dir": "Output folder (optional)",
    "grpo.num_generations": "Generations per prompt", "grpo.max_completion_length": "Max completion tokens",
    "grpo.max_prompt_length": "Max prompt tokens", "grpo.beta": "KL weight beta", "grpo.epsilon": "Clip epsilon",
    "grpo.loss_type": "Loss type", "grpo.temperature": "Sampling temperature", "grpo.top_p": "Sampling top-p",
    "preference.finetune": "Trains", "preference.beta": "Beta", "preference.loss_type": "DPO loss type",
    "preference.label_smoothing": "Label smoothing (DPO robust, exo_pair)",
    "preference.simpo_gamma": "SimPO margin gamma", "preference.cpo_alpha": "SimPO NLL weight (cpo_alpha)",
    "preference.desirable_weight": "KTO desirable weight", "preference.undesirable_weight": "KTO undesirable weight",
    "preference.precompute_ref_logps": "Precompute reference log-probs",
    "eval_split": "Hold out for evaluation (share of the dataset's rows; 0: none)",
    "eval_dataset": "Or an evaluation file (its name on the Datasets tab, or a path; leave the share at 0)",
    "eval_steps": "Evaluate every N steps (empty: automatic, at most 5% of the training time)",
    "early_stopping.patience": "Early stopping: patience (evaluations; 0: off)",
    "early_stopping.min_delta": "Early stopping: minimum improvement",
    "report_to": "Also report to (TensorBoard files are always written)",
}

# --- runs tab --------------------------------------------------------------------------------
RU_TABLE = "Jobs"
RU_SELECT = "Run"
RU_REFRESH = "Refresh"
RU_PAUSE = "Stop (resumable)"
RU_RESUME = "Resume"
RU_CANCEL = "Cancel"
RU_DELETE = "Delete"
RU_DELETE_FILES = "Also delete its files"
RU_LOG = "Log (last lines)"
RU_COMPARE = "Compare runs"
RU_COMPARE_BTN = "Compare"
RU_COMPARE_LOSS = "Loss of the compared runs"
RU_CONFIG_DIFF = "Settings that differ"
RU_COLUMNS = ["#", "name", "status", "progress", "ETA", "started"]
RU_NO_JOBS = "No runs yet. Start one on the Train tab."
RU_PROGRESS = "#{job} {name}: **{status}** · step {step} / {total}{eta}{error}"
RU_ETA = "ETA {eta}"
RU_BEST = " · best weights: {metric} {value:.4f} at step {step} (best/; Chat and Export use them by default)"
RU_ACTION_DONE = {"pause": "Job #{job}: stopping after its next checkpoint (resumable).",
                  "cancel": "Job #{job}: {result}.", "resume": "Job #{job} queued again; it resumes from its last checkpoint.",
                  "delete": "Job #{job} deleted."}
RU_PICK = "Pick a run first."
RU_PICK_TWO = "Pick at least two runs to compare."
RU_SAME_CONFIG = "The runs have the same settings."
RU_GENERATION = "Generation check (held-out prompts, answered greedily at the end of the run)"
RU_GEN_COLUMNS = ["prompt", "reference", "answer", "exact match", "ROUGE-L"]
RU_GEN_SUMMARY = "{n} held-out prompts at step {step}: exact match **{exact:.0%}**, ROUGE-L **{rouge:.3f}**"
RU_GEN_CUT = "[cut: time budget]"  # beside an answer the end-of-run check's time budget cut
RU_GEN_CUT_NOTE = ("{n} answers were cut at the check's time budget ({seconds:.1f} s, which keeps evaluation within "
                   "5% of the training time), so their scores read low; 'Check generations' answers them in full.")
RU_GEN_NONE = "No generation check for this run (it runs at the end of a run with eval_split or eval_dataset)."
RU_GEN_CHECK = "Check generations"
RU_GEN_RUNNING = "Answering run #{job}'s held-out prompts with its {weights} ({seconds:.0f} s so far)…"
RU_GEN_NOT_FINISHED = "Run #{job} is {status}; check its generations once it has finished."
RU_GEN_NO_EVAL = ("Run #{job} has no held-out prompts: it trained without eval_split or eval_dataset. Train with "
                  "eval_split (e.g. 0.05) to check generations.")
RU_GEN_FAILED = "The generation check of run #{job} failed ({why}): {detail}"
RU_GEN_CRASHED = "its process ended with {signal}"
RU_GEN_EXIT = "exit status {code}"
RU_GEN_TIMEOUT = "The generation check of run #{job} took longer than {minutes} minutes and was stopped."
CHARTS = {"loss": "Loss (train, eval)", "lr": "Learning rate", "grad_norm": "Grad norm", "tokens_per_s": "Tokens / s",
          "memory": "GPU memory (GiB)", "reward": "Reward (GRPO) / rewards (preference)", "kl": "KL (GRPO, KTO)"}
RU_MEMORY_CPU = "GPU memory: none, this run trains on the CPU"

# --- chat tab --------------------------------------------------------------------------------
CH_MODEL = "Model"
CH_SIDE = "Side by side with the base model"
CH_BASE = "Base model"
CH_TUNED = "Fine-tuned"
CH_MESSAGE = "Message"
CH_SEND = "Send"
CH_STOP = "Stop"
CH_CLEAR = "New conversation"
CH_SYSTEM = "System prompt"
CH_SAMPLING = "Sampling"
CH_TEMPLATE = "Chat template of this model"
CH_REFRESH = "Refresh models"
CH_BASE_CHOICE = "Base: {model}"
CH_RUN_CHOICE = "Run #{job}: {name}"
CH_NEED_RUN = "Side by side needs a fine-tuned run: pick one under Model."
CH_EMPTY = "Type a message first."
CH_LOADING = "Loading {model}…"
CH_STOPPED = "(stopped)"
CH_BAD_TARGET = "Unknown model choice {target!r}: press Refresh models and pick again."
CH_AT_STEP = " · step {step}"
CH_BEST = " (best weights)"
CH_CHECKPOINT = "Weights of the run"
CH_SPEED = "**{name}**: {tokens} tokens in {seconds:.1f} s · {rate:.1f} tokens/s (prompt included)"
CH_DEMO_NOTE = ("**Note:** the built-in demo model is a tiny model with random weights, there to try the studio "
                "in a minute on any machine. Its answers are gibberish; that is expected, not a fault.")
CH_DEMO_RUN_NOTE = ("**Note:** this run was trained from the built-in demo model, a tiny model with random weights. "
                    "A few steps of training teach it little, so its answers are still mostly gibberish; train a "
                    "real model (a hub id or a local folder) for real answers.")

# --- export tab ------------------------------------------------------------------------------
EX_RUN = "Run to export"
EX_FORMAT = "Format"
EX_FORMATS = {"adapter": "LoRA adapter (small; needs the base model)", "merged": "Merged 16-bit model",
              "gguf": "GGUF for llama.cpp and Ollama"}
EX_QUANT = "Quantization (GGUF) / dtype (merged)"
EX_START = "Export"
EX_FILE = "Download"
EX_MODELFILE = "Ollama Modelfile (save beside the .gguf, then `ollama create NAME -f Modelfile`)"
EX_DONE = "Exported in {seconds:.1f} s to `{out}`."
EX_NO_RUNS = "No finished run to export yet."
EX_FOLDER_ONLY = "The export is {size:.1f} GiB: too large to zip for the browser; it is in `{out}`."
EX_QUEUED = "Export #{job} is queued: it starts when the export before it ends."
EX_FAILED = "Export #{job} failed: {error}"
EX_STOPPED = "Export #{job} was {status} before it finished; nothing was kept."
EX_CHECKPOINT = "Weights of the run"
EX_CHECKS = "**Checks** (the same as `python -m kestrel export` prints):"
EX_CHECK_LINE = "- {name}: **{verdict}** · {details}"
EX_CHECK_INFO = "- {name}: {details}"
EX_QUANT_HINT = "{quant} · {size} · {note}"
EX_QUANT_NO_SIZE = "{quant} · {note}"
EX_SIZE_ABOUT = "about {size}"
EX_SIZE_UP_TO = "up to {size}"
EX_QUANT_INFO = "Sizes for this model's {params} weights at each type's typical bits per weight."
EX_QUANT_INFO_BOUND = ("Sizes are upper bounds: this model's rows ({params} weights) are too narrow for k-quant "
                       "blocks of 256, so llama.cpp stores some tensors in wider types.")
EX_RECENT = "Recent exports (they go on when this page or the studio closes)"
EX_RECENT_NONE = "No exports yet."
EX_RECENT_COLUMNS = ["#", "export", "status", "download"]
EX_IN_FOLDER = "in `{out}`"

# --- errors (user-facing; never a traceback) -------------------------------------------------
ERR_EXTENSION = "{name}: unsupported file type. Upload one of {allowed}."
ERR_EMPTY = "{name} is empty: there is nothing to train on."
ERR_TOO_BIG = "{name} is {size:.0f} MiB, over the upload limit of {limit:.0f} MiB (app.py --max-upload-mb)."
ERR_BAD_NAME = "Could not store the upload {name!r}: pick a simpler file name."
ERR_NO_FILE = "No file was received; try the upload again."
ERR_MODEL_FOLDER = "Model folder {path} does not exist."
ERR_MODEL_NO_CONFIG = "Model folder {path} has no config.json: point at the folder holding config.json and *.safetensors."
ERR_HUB_OFFLINE = ("Model {model!r} is not a local folder and is not in the Hugging Face cache, and this machine is "
                   "offline (HF_HUB_OFFLINE is set). Pick a local folder or the built-in demo model.")
ERR_MODEL_EMPTY = "Enter a model folder or a hub id, or pick the built-in demo model."
ERR_DATASET_MISSING = "Dataset {path} does not exist any more; upload it again or pick a sample."
ERR_EVAL_MISSING = ("eval_dataset {path} does not exist: upload the file on the Datasets tab and name it here, or "
                    "hold rows of the dataset out instead (the share above).")
ERR_DATASET_OUTSIDE = ("{field} {path!r} is outside the studio's folder: the studio reads only files inside {home} "
                       "(KESTREL_HOME) and the shipped samples. Upload the file on the Datasets tab, or copy it into "
                       "{home}/datasets.")
ERR_OUTPUT_OUTSIDE = ("output_dir {path!r} is outside {runs}: runs started in the studio are written there. Give a "
                      "folder name such as my-run (it becomes {runs}/my-run), or leave it empty; the command line "
                      "(python -m kestrel train) can write anywhere.")
ERR_FOLDER_OUTSIDE = ("{field} {path!r} is outside the studio's folder: the studio reads local models and adapters only "
                      "inside {home} (KESTREL_HOME), e.g. {home}/models/<name> or a run's folder. Copy the folder "
                      "there, or use a hub id; the command line (python -m kestrel train) can read it anywhere.")
ERR_PATH_UNUSABLE = "{field} {path!r} cannot be used: {error}"
ERR_NUMBER = "{field} must be a number, got {value!r}."
ERR_QLORA_CPU = "QLoRA needs an NVIDIA GPU and none was found; choose LoRA (16-bit) instead."
ERR_UNEXPECTED = "Something went wrong ({kind}); details are in the studio's terminal."

# --- presets of the train form (values in kestrel.studio.handlers.presets.PRESETS) --------------------
PRESET_NAMES = {
    "demo": "Quick test: built-in demo model on the CPU (about a minute)",
    "qlora_8b": "QLoRA: a 7-8B model on a 12-24 GB GPU",
    "lora_quality": "LoRA 16-bit: higher rank, careful learning rate",
    "long_context": "Long context: offloaded checkpointing, batch 1",
    "full_small": "Full fine-tune: models up to about 1B",
    "grpo": "GRPO on the arithmetic prompts (first pick a finished demo run under Model: Local folder)",
    "dpo": "DPO on the arithmetic preference pairs (first pick a finished demo run under Model: Local folder)",
}
TR_REWARDS_INFO = (
    "**Rewards.** `exact_answer`: the completion's final number (or `\\boxed{}` value, or `<answer>` tag) "
    "equals the dataset's `answer` column. `format_regex`: 1 when `pattern` matches. `length_penalty`: 0 up "
    "to `target_length` tokens, then down to -1. `json_valid`: 1 when the completion is valid JSON. "
    "`custom`: `path` to a Python file defining `reward(prompts, completions, answers)`; it runs with your "
    "permissions inside the training job's process, so only whoever started the studio can allow it."
)
TR_CUSTOM_ON = ("Custom reward code: **allowed** (this studio was started with `--allow-custom-rewards`; a `custom` "
                "reward's file runs inside the training job).")
TR_CUSTOM_OFF = ("Custom reward code: **off**. Whoever starts the studio can allow it with "
                 "`python app.py --allow-custom-rewards`.")
ERR_CUSTOM_OFF = ("grpo.rewards: a `custom` reward runs code from {path}, and custom reward code is off in this "
                  "studio; whoever started it can allow it with `python app.py --allow-custom-rewards`, or use a "
                  "built-in reward.")
ERR_REWARD_ROW = "Rewards table, row {row}: {problem}."
WEIGHTS_FINAL = "Final weights"
WEIGHTS_BEST = "Best weights: {metric} {value:.4f} at step {step}"
ERR_BEST_GONE = "Run #{job} has no best weights (they are kept only by a run with an evaluation set). Pick others."
WEIGHTS_STEP = "Checkpoint at step {step}"
ERR_CHECKPOINT_CHOICE = "Weights {value!r}: choose the best or final weights or a checkpoint's step from the list."
ERR_CHECKPOINT_GONE = ("Run #{job} has no checkpoint of step {step} any more (training keeps only the newest); "
                       "checkpoints kept: {kept}. Pick another from the list.")
ERR_RUN_NO_WEIGHTS = "Run #{job} has no saved adapter or model (it is {status})."
ERR_SEED = "The seed must be a whole number, or empty for a random one; got {value!r}."
ERR_HUB_ID = "{model!r} is not a valid hub id ({error})."
ERR_TOKENIZER = "Could not load the tokenizer of {model!r}: {error}"
ERR_NO_TOKEN_COUNTS = " (no token counts: {error})"
ERR_UNKNOWN_ACTION = "Unknown action {action!r}."
ERR_WHOLE = "{field} must be a whole number, got {value!r}."
ERR_PRESET = "Unknown preset {preset!r}."
TR_DEVICES_FOUND = "GPUs found: {gpus}. Several devices train one run data parallel (LoRA, QLoRA; full fine-tuning sharded)."
TR_DEVICES_NONE = "No GPU found: a count N runs N CPU processes (slow; for checking a multi-GPU config)."

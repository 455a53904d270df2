//! # ocr-translate
//!
//! A team's pipeline on idemstage, `ocr → translate`, written the way a team
//! outside our crates writes one: nothing of ours but the facade `idemstage`, its
//! own tables ([`MIGRATIONS`]), its own Diesel schema ([`schema`]) and its own
//! stages.
//!
//! - [`Ocr`] splits the item's input text into pages (on blank lines and form
//!   feeds), replaces the item's `ocr_pages` with them, and hands the pages on
//!   (its `Output`). Its policy is `Rerun`: the item started again with another
//!   text is OCRed again, and `translate` runs again once that succeeded.
//! - [`Translate`] reads those pages as its `Input` (the output of the ocr
//!   attempt its run is bound to, never a newer one) and writes one row of
//!   `translations` per page (a deterministic stand-in for a translation:
//!   [`translate_text`]). Which ocr attempt it read is the core's record
//!   (`stage_runs.upstream_attempt`), not a column of the team's.
//!
//! Both write through the fenced transaction ([`idemstage::fenced::FencedTx`]): a page or
//! translation exists only if the attempt that wrote it succeeded, and only the
//! current success of each stage has rows. [`Faults`] injects failures after the
//! writes, for tests.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://localhost/app";
//! // The core's migrations, then this pipeline's.
//! idemstage::db::migrate_with(url, vec![ocr_translate::MIGRATIONS]).await?;
//! let pool = idemstage::db::connect_pool(url, Default::default()).await?;
//! let pipeline = ocr_translate::pipeline();
//! let tenant = idemstage::ids::TenantId::parse("acme")?;
//! let item = idemstage::ids::ItemId::new();
//! idemstage::pipeline::start(&pool, &pipeline, &tenant, &item, "page one\n\npage two").await?;
//! // ... and a `PipelineWorker` over `pipeline` works it.
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

use idemstage::diesel_migrations::{self, embed_migrations, EmbeddedMigrations};
use idemstage::serde_json::json;
use idemstage::{
    async_trait, fenced::FencedTx, pipeline::Pipeline, stage::Done, stage::InputChangePolicy,
    stage::PrepareContext, stage::Stage, stage::StageError, stage::StagePolicy,
};

pub mod schema;
mod tables;

pub use tables::{OcrPage, OcrTables, Translation};

/// This pipeline's migrations (`ocr_pages`, `translations`), to run after the
/// core's: `idemstage::db::migrate_with(url, vec![MIGRATIONS])`. Their versions
/// (`2026-12-01-1000xx`) cannot collide with the core's (`2026-11-30-0000xx`).
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// The name of the first stage.
pub const OCR: &str = "ocr";
/// The name of the second stage.
pub const TRANSLATE: &str = "translate";

/// Splits an input text into pages: a form feed ends a page, and so does a blank
/// line (one that is empty or only whitespace). Lines keep their order, lose
/// trailing whitespace; pages with no text are dropped. Any input with a
/// non-whitespace character (which every registered input has) gives a page.
pub fn split_pages(text: &str) -> Vec<String> {
    let mut pages = Vec::new();
    for sheet in text.split('\x0c') {
        let mut page: Vec<&str> = Vec::new();
        for line in sheet.lines() {
            if line.trim().is_empty() {
                if !page.is_empty() {
                    pages.push(page.join("\n"));
                    page.clear();
                }
            } else {
                page.push(line.trim_end());
            }
        }
        if !page.is_empty() {
            pages.push(page.join("\n"));
        }
    }
    pages
}

/// The deterministic stand-in for a translation: every line's words in reverse
/// order, upper-cased (`"hallo schöne welt"` → `"WELT SCHÖNE HALLO"`).
pub fn translate_text(text: &str) -> String {
    text.lines()
        .map(|line| {
            let words: Vec<String> = line
                .split_whitespace()
                .rev()
                .map(str::to_uppercase)
                .collect();
            words.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What an injected fault does, after the stage's writes, inside its fenced
/// transaction (which must then roll them back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The body returns a transient (retryable) error.
    Error,
    /// The body panics.
    Panic,
}

/// A fault of one stage: `kind`, on every attempt up to `through_attempt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The last attempt hit (attempts count on across reruns of the stage).
    pub through_attempt: i32,
}

impl Fault {
    /// A transient error on every attempt.
    pub fn error() -> Self {
        Self {
            kind: FaultKind::Error,
            through_attempt: i32::MAX,
        }
    }

    /// A panic on every attempt.
    pub fn panic() -> Self {
        Self {
            kind: FaultKind::Panic,
            through_attempt: i32::MAX,
        }
    }

    /// The same fault, on attempts `1..=n` only (then the stage recovers).
    pub fn through_attempt(self, n: i32) -> Self {
        Self {
            through_attempt: n,
            ..self
        }
    }

    fn inject(fault: Option<Fault>, stage: &str, attempt: i32) -> Result<(), StageError> {
        match fault {
            Some(f) if attempt <= f.through_attempt => match f.kind {
                FaultKind::Error => Err(StageError::Transient(
                    format!("injected failure in {stage}, attempt {attempt}").into(),
                )),
                FaultKind::Panic => panic!("injected panic in {stage}, attempt {attempt}"),
            },
            _ => Ok(()),
        }
    }
}

/// Failure injection for tests: a fault per stage (none by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Hits `ocr` after it replaced the pages and wrote its audit entry.
    pub ocr: Option<Fault>,
    /// Hits `translate` after it wrote the translations and its audit entry.
    pub translate: Option<Fault>,
}

/// The ocr stage's policy: the default, but `Rerun` on new input.
pub fn ocr_policy() -> StagePolicy {
    StagePolicy::default().with_on_input_change(InputChangePolicy::Rerun)
}

/// Stage 1: the item's input text into `ocr_pages`.
pub struct Ocr {
    policy: StagePolicy,
    fault: Option<Fault>,
}

impl Ocr {
    /// With [`ocr_policy`] and an optional injected fault.
    pub fn new(fault: Option<Fault>) -> Self {
        Self {
            policy: ocr_policy(),
            fault,
        }
    }

    /// Another policy (leases, attempts); keep `Rerun` to re-OCR new input.
    pub fn with_policy(self, policy: StagePolicy) -> Self {
        Self { policy, ..self }
    }
}

#[async_trait]
impl Stage for Ocr {
    const NAME: &'static str = OCR;
    type Input = String;
    /// The pages found.
    type Prepared = Vec<String>;
    /// The pages, handed to `translate`.
    type Output = Vec<String>;

    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }

    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<Vec<String>, StageError> {
        let pages = split_pages(ctx.input());
        if pages.is_empty() {
            return Err(StageError::Permanent("the input has no text".into()));
        }
        Ok(pages)
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _text: &String,
        pages: &Vec<String>,
    ) -> Result<Done<Vec<String>>, StageError> {
        let item = tx.token().item.to_string();
        let replaced = tx.replace_ocr_pages(pages).await?;
        tx.audit(
            &item,
            "ocr.pages",
            json!({ "pages": replaced.written, "replaced": replaced.deleted }),
        )
        .await?;
        Fault::inject(self.fault, OCR, tx.token().attempt)?;
        Ok(Done::next(pages.clone()))
    }
}

/// Stage 2: the current `ocr_pages` into `translations`.
pub struct Translate {
    policy: StagePolicy,
    fault: Option<Fault>,
}

impl Translate {
    /// With the default policy and an optional injected fault.
    pub fn new(fault: Option<Fault>) -> Self {
        Self {
            policy: StagePolicy::default(),
            fault,
        }
    }

    /// Another policy (leases, attempts).
    pub fn with_policy(self, policy: StagePolicy) -> Self {
        Self { policy, ..self }
    }
}

#[async_trait]
impl Stage for Translate {
    const NAME: &'static str = TRANSLATE;
    /// The pages of the ocr attempt this run is bound to.
    type Input = Vec<String>;
    /// Their translations.
    type Prepared = Vec<String>;
    /// How many pages it translated.
    type Output = usize;

    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }

    /// The translation (a paid call in a real pipeline), outside any transaction.
    async fn prepare(
        &self,
        ctx: &PrepareContext<'_, Vec<String>>,
    ) -> Result<Vec<String>, StageError> {
        if ctx.input().is_empty() {
            return Err(StageError::Permanent("ocr found no pages".into()));
        }
        Ok(ctx.input().iter().map(|p| translate_text(p)).collect())
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _pages: &Vec<String>,
        texts: &Vec<String>,
    ) -> Result<Done<usize>, StageError> {
        let item = tx.token().item.to_string();
        let replaced = tx.upsert_translations(texts).await?;
        tx.audit(
            &item,
            "translate.pages",
            json!({ "pages": replaced.written, "dropped": replaced.deleted }),
        )
        .await?;
        Fault::inject(self.fault, TRANSLATE, tx.token().attempt)?;
        Ok(Done::next(texts.len()))
    }
}

/// The pipeline `ocr → translate`, without faults.
pub fn pipeline() -> Pipeline {
    pipeline_with(Faults::default())
}

/// The pipeline `ocr → translate` with injected faults.
pub fn pipeline_with(faults: Faults) -> Pipeline {
    Pipeline::builder(Ocr::new(faults.ocr))
        .then(Translate::new(faults.translate))
        .build()
        .expect("ocr → translate is a valid pipeline")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_end_at_blank_lines_and_form_feeds() {
        assert_eq!(
            split_pages("one\nstill one  \n\n \t\ntwo\x0cthree\r\n\r\nfour\x0c\x0c\n"),
            vec!["one\nstill one", "two", "three", "four"]
        );
        assert_eq!(split_pages("single"), vec!["single"]);
        assert!(split_pages(" \n\x0c\n").is_empty());
    }

    #[test]
    fn the_translation_reverses_and_upper_cases_each_line() {
        assert_eq!(
            translate_text("hallo schöne welt\n  zwei   wörter "),
            "WELT SCHÖNE HALLO\nWÖRTER ZWEI"
        );
    }

    #[test]
    fn a_fault_hits_the_attempts_it_names() {
        let once = Some(Fault::error().through_attempt(1));
        assert!(Fault::inject(once, OCR, 1).is_err());
        assert!(Fault::inject(once, OCR, 2).is_ok());
        assert!(Fault::inject(None, OCR, 1).is_ok());
        let panicked = std::panic::catch_unwind(|| Fault::inject(Some(Fault::panic()), OCR, 7));
        assert!(panicked.is_err());
    }

    #[test]
    fn the_pipeline_is_ocr_then_translate_and_reruns_ocr_on_new_input() {
        let p = pipeline();
        let names: Vec<&str> = p.stages().iter().map(|s| s.name().as_str()).collect();
        assert_eq!(names, [OCR, TRANSLATE]);
        assert_eq!(
            p.first_stage().policy().on_input_change,
            InputChangePolicy::Rerun
        );
        assert_eq!(
            p.downstream_of(&idemstage::ids::StageName::parse(OCR).unwrap()),
            vec![idemstage::ids::StageName::parse(TRANSLATE).unwrap()]
        );
        // A stage name twice is refused when the pipeline is built.
        assert!(matches!(
            Pipeline::builder(Ocr::new(None))
                .then_named(OCR, Translate::new(None))
                .build(),
            Err(idemstage::pipeline::PipelineError::DuplicateStage(_))
        ));
    }
}

//! Compiled kernels for kvconductor's hot paths (see `kvconductor/kernel.py`).
//!
//! `walk` is `kvconductor.query.match`'s loop: hash the prompt block by block
//! (`identity_i = xxh3_64(block_i, seed = identity_{i-1})`) and narrow the
//! three owner bitmasks (GPU, CPU, DISK) against the namespace's tier dicts,
//! stopping at the first block nobody can serve. The index stays in Python
//! dicts keyed by identity with Python int bitmasks; the kernel only removes
//! the interpreter from the per-block loop, so both paths read the same
//! data and must give the same answers (tests/test_kernel.py).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Where the walk's identities come from.
enum Prompt<'a, 'py> {
    /// Little-endian u32 tokens, hashed lazily so a short hit never hashes
    /// the rest of a long prompt.
    Packed { data: &'a [u8], step: usize, pos: usize, ident: u64 },
    /// Identities already known (a query by engine hashes).
    Known { list: &'a Bound<'py, PyList>, pos: usize },
}

impl<'py> Prompt<'_, 'py> {
    fn next(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self {
            Prompt::Packed { data, step, pos, ident } => {
                if *pos + *step > data.len() {
                    return Ok(None);
                }
                *ident = xxh3_64_with_seed(&data[*pos..*pos + *step], *ident);
                *pos += *step;
                Ok(Some(ident.into_pyobject(py)?.into_any()))
            }
            Prompt::Known { list, pos } => {
                if *pos >= list.len() {
                    return Ok(None);
                }
                let item = list.get_item(*pos)?;
                *pos += 1;
                Ok(Some(item))
            }
        }
    }
}

/// An owner bitmask. Python ints of any width are the index's masks; the
/// walk runs on native words when every owner slot fits (slots are reused,
/// so 128 covers a fleet of 128 single-rank instances) and on Python ints
/// beyond that.
trait Mask<'py>: Sized + Clone {
    fn from_py(v: &Bound<'py, PyAny>) -> PyResult<Self>;
    fn zero(py: Python<'py>) -> PyResult<Self>;
    fn and(&self, o: &Self) -> PyResult<Self>;
    fn or(&self, o: &Self) -> PyResult<Self>;
    fn xor(&self, o: &Self) -> PyResult<Self>;
    fn same(&self, o: &Self) -> PyResult<bool>;
    fn any(&self) -> PyResult<bool>;
    fn to_py(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>>;
}

macro_rules! native_mask {
    ($t:ty) => {
        impl<'py> Mask<'py> for $t {
            fn from_py(v: &Bound<'py, PyAny>) -> PyResult<Self> {
                v.extract()
            }
            fn zero(_: Python<'py>) -> PyResult<Self> {
                Ok(0)
            }
            fn and(&self, o: &Self) -> PyResult<Self> {
                Ok(self & o)
            }
            fn or(&self, o: &Self) -> PyResult<Self> {
                Ok(self | o)
            }
            fn xor(&self, o: &Self) -> PyResult<Self> {
                Ok(self ^ o)
            }
            fn same(&self, o: &Self) -> PyResult<bool> {
                Ok(self == o)
            }
            fn any(&self) -> PyResult<bool> {
                Ok(*self != 0)
            }
            fn to_py(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                Ok(self.into_pyobject(py)?.into_any())
            }
        }
    };
}
native_mask!(u64);
native_mask!(u128);

/// Python ints, for fleets with more than 128 owner slots in a namespace.
#[derive(Clone)]
struct Wide<'py>(Bound<'py, PyAny>);

impl<'py> Mask<'py> for Wide<'py> {
    fn from_py(v: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Wide(v.clone()))
    }
    fn zero(py: Python<'py>) -> PyResult<Self> {
        Ok(Wide(0u8.into_pyobject(py)?.into_any()))
    }
    fn and(&self, o: &Self) -> PyResult<Self> {
        Ok(Wide(self.0.bitand(&o.0)?))
    }
    fn or(&self, o: &Self) -> PyResult<Self> {
        Ok(Wide(self.0.bitor(&o.0)?))
    }
    fn xor(&self, o: &Self) -> PyResult<Self> {
        Ok(Wide(self.0.bitxor(&o.0)?))
    }
    fn same(&self, o: &Self) -> PyResult<bool> {
        self.0.eq(&o.0)
    }
    fn any(&self) -> PyResult<bool> {
        self.0.is_truthy()
    }
    fn to_py(&self, _: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.0.clone())
    }
}

/// The namespace's tier dicts, passed from Python as one tuple
/// `(dev, host, disk, pool_host, pool_disk)`; a lower tier that holds
/// nothing is None.
#[derive(FromPyObject)]
struct Tiers<'py>(
    Bound<'py, PyDict>,
    Option<Bound<'py, PyDict>>,
    Option<Bound<'py, PyDict>>,
    Option<Bound<'py, PyDict>>,
    Option<Bound<'py, PyDict>>,
);

fn get_mask<'py, M: Mask<'py>>(
    d: Option<&Bound<'py, PyDict>>,
    key: &Bound<'py, PyAny>,
    zero: &M,
) -> PyResult<M> {
    if let Some(d) = d {
        if let Some(v) = d.get_item(key)? {
            return M::from_py(&v);
        }
    }
    Ok(zero.clone())
}

fn holds<'py>(d: &Option<Bound<'py, PyDict>>, key: &Bound<'py, PyAny>) -> PyResult<bool> {
    match d {
        Some(d) => d.contains(key),
        None => Ok(false),
    }
}

type Walked<'py> = (usize, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyList>);

/// The tier walk. Returns `(length, gpu, cpu, disk, changes)`: the blocks
/// walked, the owner bits still matching at the end of each tier, and
/// `(tier, at, lost_bits)` for every narrowing, in order, from which the
/// caller derives each owner's matched length.
fn walk<'py, M: Mask<'py>>(
    py: Python<'py>,
    mut prompt: Prompt<'_, 'py>,
    t: &Tiers<'py>,
    listed_py: &Bound<'py, PyAny>,
) -> PyResult<Walked<'py>> {
    let zero = M::zero(py)?;
    let listed = M::from_py(listed_py)?;
    let changes = PyList::empty(py);
    let mut g = listed.clone();
    let mut i = 0usize;
    let lower = t.1.is_some() || t.2.is_some() || t.3.is_some() || t.4.is_some();
    if !lower {
        // Device tiers only: CPU and DISK equal GPU.
        while let Some(key) = prompt.next(py)? {
            let ng = g.and(&get_mask(Some(&t.0), &key, &zero)?)?;
            if !ng.same(&g)? {
                changes.append((0u8, i, g.xor(&ng)?.to_py(py)?))?;
                g = ng;
                if !g.any()? {
                    break;
                }
            }
            i += 1;
        }
        let g = g.to_py(py)?;
        return Ok((i, g.clone(), g.clone(), g, changes));
    }
    let mut c = listed.clone();
    let mut d = listed.clone();
    while let Some(key) = prompt.next(py)? {
        // Each probe is a likely cache miss in a big dict: skip the ones
        // that cannot change the outcome (an owner off the device prefix
        // needs a lower tier; a shared pool of the host class serves all).
        let ng = if g.any()? { g.and(&get_mask(Some(&t.0), &key, &zero)?)? } else { zero.clone() };
        let (lower_c, lower_d) = if holds(&t.3, &key)? {
            (listed.clone(), listed.clone())
        } else if !d.xor(&ng)?.any()? {
            (zero.clone(), zero.clone())
        } else {
            let lower_c = get_mask(t.1.as_ref(), &key, &zero)?;
            let lower_d = if holds(&t.4, &key)? {
                listed.clone()
            } else {
                lower_c.or(&get_mask(t.2.as_ref(), &key, &zero)?)?
            };
            (lower_c, lower_d)
        };
        let nc = ng.or(&c.and(&lower_c)?)?;
        let nd = ng.or(&d.and(&lower_d)?)?;
        if !ng.same(&g)? {
            changes.append((0u8, i, g.xor(&ng)?.to_py(py)?))?;
            g = ng;
        }
        if !nc.same(&c)? {
            changes.append((1u8, i, c.xor(&nc)?.to_py(py)?))?;
            c = nc;
        }
        if !nd.same(&d)? {
            changes.append((2u8, i, d.xor(&nd)?.to_py(py)?))?;
            d = nd;
            if !d.any()? {
                break;
            }
        }
        i += 1;
    }
    Ok((i, g.to_py(py)?, c.to_py(py)?, d.to_py(py)?, changes))
}

/// `walk` on the narrowest mask type that holds `listed` (every mask the
/// walk meets is a subset of the namespace's slots, which `listed` bounds
/// only when it lists all of them, so the width comes from `slots`).
fn dispatch<'py>(
    py: Python<'py>,
    prompt: Prompt<'_, 'py>,
    t: Tiers<'py>,
    slots: usize,
    listed: &Bound<'py, PyAny>,
) -> PyResult<Walked<'py>> {
    if slots <= 64 {
        walk::<u64>(py, prompt, &t, listed)
    } else if slots <= 128 {
        walk::<u128>(py, prompt, &t, listed)
    } else {
        walk::<Wide>(py, prompt, &t, listed)
    }
}

/// `walk` over a prompt of packed little-endian u32 tokens. `slots`: the
/// namespace's owner slot count (every mask is below `1 << slots`). With all
/// four lower tiers None the walk reads only the device tiers.
#[pyfunction]
fn walk_tokens<'py>(
    py: Python<'py>,
    data: &[u8],
    block_size: usize,
    seed: u64,
    slots: usize,
    tiers: Tiers<'py>,
    listed: Bound<'py, PyAny>,
) -> PyResult<Walked<'py>> {
    let step = block_size.checked_mul(4).filter(|s| *s > 0).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err("block_size must be a positive integer")
    })?;
    let prompt = Prompt::Packed { data, step, pos: 0, ident: seed };
    dispatch(py, prompt, tiers, slots, &listed)
}

/// `walk` over identities already known.
#[pyfunction]
fn walk_identities<'py>(
    py: Python<'py>,
    idents: Bound<'py, PyList>,
    slots: usize,
    tiers: Tiers<'py>,
    listed: Bound<'py, PyAny>,
) -> PyResult<Walked<'py>> {
    let prompt = Prompt::Known { list: &idents, pos: 0 };
    dispatch(py, prompt, tiers, slots, &listed)
}

/// `kvconductor.hashing.chain_identities` without extra keys.
#[pyfunction]
fn chain_identities(data: &[u8], n_blocks: usize, block_size: usize, parent: u64) -> PyResult<Vec<u64>> {
    let step = block_size * 4;
    if step == 0 || n_blocks.checked_mul(step).is_none_or(|n| n > data.len()) {
        return Err(pyo3::exceptions::PyValueError::new_err("fewer token bytes than blocks"));
    }
    let mut ident = parent;
    Ok(data[..n_blocks * step]
        .chunks_exact(step)
        .map(|block| {
            ident = xxh3_64_with_seed(block, ident);
            ident
        })
        .collect())
}

/// `kvconductor.hashing.pack_tokens`: token ids as little-endian u32.
/// OverflowError outside u32, TypeError for a non-integer, like `array`.
#[pyfunction]
fn pack_tokens<'py>(py: Python<'py>, tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    fn push(out: &mut Vec<u8>, item: &Bound<'_, PyAny>) -> PyResult<()> {
        out.extend_from_slice(&item.extract::<u32>()?.to_le_bytes());
        Ok(())
    }
    let mut out: Vec<u8> = Vec::new();
    if let Ok(list) = tokens.cast::<PyList>() {
        out.reserve(list.len() * 4);
        for item in list.iter() {
            push(&mut out, &item)?;
        }
    } else {
        for item in tokens.try_iter()? {
            push(&mut out, &item?)?;
        }
    }
    Ok(PyBytes::new(py, &out))
}

#[pymodule]
fn _kernel(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(walk_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(walk_identities, m)?)?;
    m.add_function(wrap_pyfunction!(chain_identities, m)?)?;
    m.add_function(wrap_pyfunction!(pack_tokens, m)?)?;
    Ok(())
}

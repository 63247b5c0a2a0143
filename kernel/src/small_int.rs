//! A small int's value read from the int object itself.
//!
//! `PyLong_AsUnsignedLong` is a call into the interpreter for each token, and
//! a long prompt has thousands: a sizeable share of an in-process query.
//! CPython 3.11 keeps an int as a signed digit count followed by its 30-bit
//! digits, so one in [0, 2**30) (every token id of a real vocabulary) is a
//! count of 0 or 1 and one digit. Later versions changed the layout; there,
//! and for any int this does not recognise, the caller uses the API.

use pyo3::ffi;

#[cfg(all(not(Py_3_12), not(PyPy), not(Py_LIMITED_API)))]
mod layout {
    use std::sync::atomic::{AtomicBool, Ordering};

    use pyo3::ffi;
    use pyo3::prelude::*;

    /// Whether this interpreter's digits are the 30-bit ones read here (a
    /// build may choose 15).
    static DIGITS_30: AtomicBool = AtomicBool::new(false);

    pub fn init(py: Python<'_>) -> PyResult<()> {
        let info = py.import("sys")?.getattr("int_info")?;
        let bits: u32 = info.getattr("bits_per_digit")?.extract()?;
        let size: u32 = info.getattr("sizeof_digit")?.extract()?;
        DIGITS_30.store(bits == 30 && size == 4, Ordering::Relaxed);
        Ok(())
    }

    /// SAFETY: `item` is a live object.
    #[inline]
    pub unsafe fn read(item: *mut ffi::PyObject) -> Option<u32> {
        if !DIGITS_30.load(Ordering::Relaxed)
            || ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyLong_Type)
        {
            return None;
        }
        match (*item.cast::<ffi::PyVarObject>()).ob_size {
            0 => Some(0),
            // The first digit follows the header.
            1 => Some(*item.cast::<u8>().add(std::mem::size_of::<ffi::PyVarObject>()).cast::<u32>()),
            _ => None,
        }
    }
}

#[cfg(not(all(not(Py_3_12), not(PyPy), not(Py_LIMITED_API))))]
mod layout {
    use pyo3::ffi;
    use pyo3::prelude::*;

    pub fn init(_: Python<'_>) -> PyResult<()> {
        Ok(())
    }

    #[inline]
    pub unsafe fn read(_: *mut ffi::PyObject) -> Option<u32> {
        None
    }
}

pub use layout::init;

/// `item`'s value when it is an exact int in [0, 2**30) and the layout is
/// known; None otherwise.
///
/// # Safety
/// `item` is a live object.
#[inline]
pub unsafe fn read(item: *mut ffi::PyObject) -> Option<u32> {
    layout::read(item)
}
